"""CUDA-graph capture as the GPU tests check it (docs/DESIGN.md §5, §5.1: every op capturable).

One helper for what each GPU test file's graph test does: warm the call up on a side stream (lazy
initialisation and first allocations stay outside the capture), capture one call, poison what it
returned, replay, and require the replay to reproduce the eager results bit for bit. The test
files import it by name (conftest.py puts this folder on sys.path, as for kernel_package)."""

import torch


def _tensors(outputs):
    return (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)


def assert_graph_replays_eager(fn, eager, *, defined=None, warmup=2):
    """Capture `fn()` in a CUDA graph and assert one replay equals `eager` bit for bit.

    fn: a no-argument callable running the op(s) under test; it returns the output tensor or a
        tuple/list of them (an in-place op's `out` buffer counts).
    eager: the same outputs from an eager run (a tensor or a sequence, matching fn's).
    defined: maps fn's outputs (and eager) to the parts the op specifies, when some elements are
        unspecified (e.g. rows past num_tokens_post_padded); None compares everything.

    fn runs `warmup` times on a side stream, then once under capture; every captured output is
    filled with NaN before the replay, so an element the replay does not write fails the
    comparison. Returns (graph, outputs) so a test can change the inputs in place and replay again.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    for t in _tensors(captured):
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    view = defined if defined is not None else (lambda outputs: outputs)
    got, want = _tensors(view(captured)), _tensors(view(eager))
    assert len(got) == len(want), (len(got), len(want))
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i}: the graph replay differs from the eager run"
    return graph, captured
