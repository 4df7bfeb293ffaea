"""The differentiable MoE: `moe(x, w1, w2, w3, topk_ids, topk_weights, *, mxfp8=False)`.

Forward: `moe_align`, then the fused op (`fused_moe_bf16`, or `fused_moe_mxfp8` on the inputs
quantized per call). Backward (docs/DESIGN.md §5.1): gradients for x, w1, w2, w3 and
topk_weights, each in its input's dtype, deterministic (no float atomics: every sum has a fixed
order), no host synchronisation. The MXFP8 forward's backward is the bf16 one on the original
inputs (straight-through): what prime-rl's layer computes for plain weight tensors (with torchao's
MXFP8 training weights its backward GEMMs run in MXFP8 instead). `FusedMoE.apply` is `moe` with
the argument list of prime-rl's `_FusedMoE.apply`, so that class can be swapped for it.

Two backwards; `moe` picks by `fused_backward_serves(I)`:
- `fused_backward` (I % 64 == 0, every shape of DESIGN): the bf16 forward saves the gate/up
  pre-activations (2 * L * I bf16, `preact`) and `fused_moe_bf16_dgrad` turns grad_out into
  grad_x, dA|dB, s*h and the score gradient in two fused GEMMs, and `fused_moe_bf16_wgrad` the
  three weight gradients in two more (each expert's token rows gathered in the operand loads).
- `composed_backward` (any other I): composed from `torch._grouped_mm` over moe_align's padded
  layout, the pre-activations recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import (fused_moe_bf16, fused_moe_bf16_dgrad, fused_moe_bf16_wgrad, fused_moe_mxfp8, moe_align, preact_numel,
               quantize_mxfp8)


def _live(sorted_ids: torch.Tensor, ntpp: torch.Tensor, n_slots: int):
    """(positions, live): moe_align's positions 0..L-1 and which of them hold a routed slot."""
    positions = torch.arange(sorted_ids.numel(), device=sorted_ids.device, dtype=torch.int32)
    return positions, (sorted_ids >= 0) & (sorted_ids < n_slots) & (positions < ntpp)


def _position_maps(routing, n_slots: int, num_experts: int):
    """What the composed backward needs beside moe_align's layout `routing`: per position the token
    (0 for padding), a live mask, grouped_mm's group ends, and per slot its position (L, a zero
    row, if dropped)."""
    sorted_ids, expert_ids, ntpp, top_k = routing
    L = sorted_ids.numel()
    positions, live = _live(sorted_ids, ntpp, n_slots)
    slot = torch.where(live, sorted_ids, torch.zeros_like(sorted_ids)).long()
    token = slot // top_k
    offs = _group_ends(expert_ids, num_experts, L)
    inv = torch.full((n_slots + 1,), L, dtype=torch.long, device=slot.device)
    inv.scatter_(0, torch.where(live, slot, n_slots), positions.long())  # padding all lands on the spare entry
    return live, token, slot, offs, inv[:n_slots]


def _by_slot(rows: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """rows (by sorted position) gathered by slot: rows[inv[s]], a zero row for a dropped slot."""
    return torch.cat([rows, rows.new_zeros(1, *rows.shape[1:])])[inv]


def _gather_sum(rows: torch.Tensor, inv: torch.Tensor, top_k: int) -> torch.Tensor:
    """out[t] = sum over k ascending of rows[inv[t * top_k + k]], in fp32."""
    return _by_slot(rows, inv).reshape(-1, top_k, *rows.shape[1:]).float().sum(1)


def composed_backward(grad_out, x, w1, w2, w3, topk_weights, routing, needs_input_grad=(True,) * 5):
    """Gradients of `moe` w.r.t. (x, w1, w2, w3, topk_weights), each in its input's dtype (None
    where `needs_input_grad` says so), from grouped GEMMs with the pre-activations recomputed:
    what `moe` runs when I % 64 != 0. Arguments as `fused_backward`'s (routing: the forward's
    moe_align layout and top_k), without preact."""
    E, I, K = w1.shape
    top_k = routing[3]
    live, token, slot, offs, inv = _position_maps(routing, topk_weights.numel(), E)
    mask = live.unsqueeze(1)
    bf = torch.bfloat16
    w = torch.cat([w1.to(bf), w3.to(bf)], dim=1)  # (E, 2I, K)
    w2b = w2.to(bf)
    xs = torch.where(mask, x.to(bf)[token], 0)  # (L, K) token rows by position, padding zero
    gs = torch.where(mask, grad_out.to(bf)[token], 0)
    weight = torch.where(live, topk_weights.reshape(-1).float()[slot], 0.0).unsqueeze(1)  # (L, 1)

    ab = torch._grouped_mm(xs, w.transpose(-2, -1), offs=offs)  # recomputed pre-activations (L, 2I)
    a, b = ab[:, :I].float(), ab[:, I:].float()
    silu_a = F.silu(a)
    h = (silu_a * b).to(bf)  # as the forward stores it
    dh_unweighted = torch._grouped_mm(gs, w2b, offs=offs).float()  # d out / d h without the router weight

    grads = [None] * 5
    if needs_input_grad[4]:
        score = (h.float() * dh_unweighted).sum(1)  # d out / d weight = <y, g> = <h, g W2>
        grads[4] = _by_slot(score, inv).reshape_as(topk_weights)
    dh = dh_unweighted * weight
    sig = torch.sigmoid(a)
    da = dh * b * sig * (1 + a * (1 - sig))  # silu'(a) = sig (1 + a (1 - sig))
    db = dh * silu_a
    dab = torch.cat([da, db], dim=1).to(bf)  # (L, 2I)
    if needs_input_grad[0]:
        grads[0] = _gather_sum(torch._grouped_mm(dab, w, offs=offs), inv, top_k)
    if needs_input_grad[1] or needs_input_grad[3]:
        dw = torch._grouped_mm(dab.t(), xs, offs=offs)  # (E, 2I, K), each expert's rows summed by the GEMM
        grads[1], grads[3] = dw[:, :I], dw[:, I:]
    if needs_input_grad[2]:
        grads[2] = torch._grouped_mm((gs.float() * weight).to(bf).t(), h, offs=offs)  # (E, K, I)
    inputs = (x, w1, w2, w3, topk_weights)
    return tuple(None if g is None else g.to(t.dtype).contiguous() for g, t in zip(grads, inputs))


def fused_backward_serves(hidden_dim: int) -> bool:
    """Whether `moe` runs `fused_backward` for this I: fused_moe_bf16_dgrad's rule, I a multiple
    of 64 (else `composed_backward`)."""
    return hidden_dim % 64 == 0


def _forward(x, w1, w2, w3, topk_weights, routing, mxfp8, preact=None, preact_only=False):
    """The fused forward on moe_align's `routing`; with `preact`, also the pre-activations
    (bf16 only: the MXFP8 op does not save them); with preact_only, those alone (the gate/up
    GEMM) and None."""
    sorted_ids, expert_ids, ntpp, top_k = routing
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    weights = topk_weights.to(torch.float32).contiguous()
    if mxfp8:
        xq, xs = quantize_mxfp8(x.to(torch.bfloat16).contiguous())
        wq, ws = quantize_mxfp8(torch.cat([w1, w3], dim=1).to(torch.bfloat16).contiguous(), blocked=True)
        w2q, w2s = quantize_mxfp8(w2.to(torch.bfloat16).contiguous(), blocked=True)
        fused_moe_mxfp8(xq, xs, wq, ws, w2q, w2s, sorted_ids, expert_ids, ntpp, weights, out, top_k)
    else:
        bf = torch.bfloat16
        fused_moe_bf16(x.to(bf).contiguous(), w1.to(bf).contiguous(), w2.to(bf).contiguous(), sorted_ids, expert_ids,
                       ntpp, weights, out, top_k, preact=preact, w3=w3.to(bf).contiguous(), preact_only=preact_only)
    return None if preact_only else out.to(x.dtype)


def _group_ends(expert_ids: torch.Tensor, num_experts: int, sorted_len: int) -> torch.Tensor:
    """torch._grouped_mm's offsets over moe_align's layout: expert e's rows (its blocks, in expert
    order) end at offs[e]."""
    block = expert_ids.long()
    # scatter_add, not bincount: bincount sizes its output on the host (a sync).
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=block.device)
    counts.scatter_add_(0, torch.where(block >= 0, block, num_experts), torch.ones_like(block, dtype=torch.int32))
    return (torch.cumsum(counts[:num_experts], 0) * (sorted_len // block.numel())).to(torch.int32)


def fused_backward(grad_out, x, w1, w2, w3, topk_weights, routing, preact, needs_input_grad=(True,) * 5, bpc=None):
    """Gradients of `moe` from the fused kernels: `fused_moe_bf16_dgrad` (grad_x, dA|dB, s*h and
    the score gradient from the saved pre-activations), then `fused_moe_bf16_wgrad` (the three
    weight gradients, each expert's rows the reduction). Needs `fused_backward_serves(I)`.

    Args:
        grad_out: (M, K) gradient of `moe`'s output, any float dtype (computed in bf16).
        x, w1, w2, w3, topk_weights: `moe`'s inputs (shapes and dtypes as there).
        routing: (sorted_token_ids, expert_ids, num_tokens_post_padded, top_k) of `moe_align`
            on the forward's topk_ids.
        preact: the bf16 tensor of `preact_numel(len(sorted_token_ids), I)` elements that
            `fused_moe_bf16(..., preact=)` filled in the forward on the same routing.
        needs_input_grad: which of (x, w1, w2, w3, topk_weights) to return (None for the others).
        bpc: 1, or 2 to run the dgrad and wgrad GEMMs as CTA pairs; None (the default,
            what `moe` runs) takes `preferred_bpc(..., backward=True)` of the shape. Same bits.

    Returns the gradients of (x, w1, w2, w3, topk_weights), each in its input's dtype.
    Deterministic (no float atomics), no host synchronisation, CUDA-graph capturable."""
    sorted_ids, expert_ids, ntpp, top_k = routing
    E = w1.shape[0]
    bf = torch.bfloat16
    g = grad_out.to(bf).contiguous()
    gx, dab, sh, score = fused_moe_bf16_dgrad(g, w1.to(bf).contiguous(), w3.to(bf).contiguous(), w2.to(bf).contiguous(),
                                              preact, sorted_ids, expert_ids, ntpp,
                                              topk_weights.to(torch.float32).contiguous(), top_k, bpc=bpc)
    grads = [gx if needs_input_grad[0] else None, None, None, None, score if needs_input_grad[4] else None]
    if any(needs_input_grad[1:4]):  # one op computes all three (training needs all three)
        gw1, gw3, gw2 = fused_moe_bf16_wgrad(x.to(bf).contiguous(), g, dab, sh, sorted_ids, expert_ids, ntpp, E, top_k,
                                             bpc=bpc)
        grads[1:4] = [t if need else None for t, need in zip((gw1, gw2, gw3), needs_input_grad[1:4])]
    inputs = (x, w1, w2, w3, topk_weights)
    return tuple(None if t is None else t.to(i.dtype).contiguous() for t, i in zip(grads, inputs))


class _MoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, w3, topk_ids, topk_weights, mxfp8, training):
        E, I, _ = w1.shape
        top_k = topk_ids.shape[1]
        sorted_ids, expert_ids, ntpp = moe_align(topk_ids.to(torch.int32).contiguous(), E)
        routing = (sorted_ids, expert_ids, ntpp, top_k)
        fused = training and fused_backward_serves(I)
        # The bf16 forward saves the pre-activations for the fused backward as it runs; the MXFP8
        # forward's backward (straight-through, bf16) recomputes them with the bf16 forward.
        preact = None
        if fused and not mxfp8:
            preact = torch.empty(preact_numel(sorted_ids.numel(), I), dtype=torch.bfloat16, device=x.device)
        out = _forward(x, w1, w2, w3, topk_weights, routing, mxfp8, preact)
        ctx.fused, ctx.top_k = fused, top_k
        ctx.save_for_backward(x, w1, w2, w3, topk_weights, sorted_ids, expert_ids, ntpp, preact)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, w1, w2, w3, topk_weights, sorted_ids, expert_ids, ntpp, preact = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[i] for i in (0, 1, 2, 3, 5))
        routing = (sorted_ids, expert_ids, ntpp, ctx.top_k)  # the forward's alignment, for both backwards
        if ctx.fused:
            if preact is None:  # the MXFP8 forward: the bf16 forward's pre-activations (its gate/up GEMM)
                preact = torch.empty(preact_numel(sorted_ids.numel(), w1.shape[1]), dtype=torch.bfloat16,
                                     device=x.device)
                _forward(x, w1, w2, w3, topk_weights, routing, False, preact, preact_only=True)
            grads = fused_backward(grad_out.contiguous(), x, w1, w2, w3, topk_weights, routing, preact, needs)
        else:
            grads = composed_backward(grad_out.contiguous(), x, w1, w2, w3, topk_weights, routing, needs)
        gx, gw1, gw2, gw3, gs = grads
        return gx, gw1, gw2, gw3, None, gs, None, None


def moe(x, w1, w2, w3, topk_ids, topk_weights, *, mxfp8: bool = False):
    """Routed-expert MoE, differentiable w.r.t. x, w1, w2, w3 and topk_weights.

    out[t] = sum_k topk_weights[t,k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])), e = topk_ids[t,k].

    Args:
        x: (M, K) tokens (bf16, or any float dtype: computed in bf16, returned in x's dtype).
        w1, w3: (E, I, K) gate and up projections; w2: (E, K, I) down projection. Any float dtype
            (fp32 master weights get fp32 gradients); computed in bf16.
        topk_ids: (M, top_k) integer expert ids; -1 (or any id outside [0, E)) drops the slot: it
            contributes nothing and its topk_weights gradient is 0.
        topk_weights: (M, top_k) router weights (any float dtype).
        mxfp8: run the forward on MXFP8-quantized x, w and w2 (`fused_moe_mxfp8`); the backward is
            the bf16 one on the unquantized inputs (straight-through).

    Shapes must satisfy `unsupported_shape_reason(K, I, mxfp8=mxfp8)`. Deterministic: the same
    inputs give bit-identical outputs and gradients.
    """
    # Grad mode is off inside Function.forward: whether a backward will follow is decided here.
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, w2, w3, topk_weights))
    return _MoE.apply(x, w1, w2, w3, topk_ids, topk_weights, bool(mxfp8), training)


class FusedMoE:
    """prime-rl's `_FusedMoE` replaced: `FusedMoE.apply(x, w1, w2, w3, selected_experts_indices,
    top_scores, num_experts, mxfp8)` is `moe(x, w1, w2, w3, selected_experts_indices, top_scores,
    mxfp8=mxfp8)`, so prime-rl's layer runs our forward and backward with its call unchanged.
    num_experts must be w1.shape[0] (prime-rl passes its expert count; it runs without expert
    parallelism, so the local weights hold every expert)."""

    @staticmethod
    def apply(x, w1, w2, w3, selected_experts_indices, top_scores, num_experts, mxfp8=False):
        if num_experts != w1.shape[0]:
            raise ValueError(f"FusedMoE.apply: num_experts must equal w1.shape[0] (the experts the weights hold), "
                             f"got num_experts={num_experts}, w1.shape={tuple(w1.shape)}")
        return moe(x, w1, w2, w3, selected_experts_indices, top_scores, mxfp8=bool(mxfp8))
