// generated from common/torch_check.h: edit there and run scripts/sync_common.py
// PK_CHECK(cond, pieces...): TORCH_CHECK whose message is assembled from std::string pieces only.
// Streaming an integer into a TORCH_CHECK message (through c10::str / std::ostream) crashed on the
// H200 image (SIGSEGV in std::basic_ostream::_M_insert<long> / codecvt, torch 2.11 with the local
// builder) while strings were fine, so numbers, shapes, devices, dtypes and pointers are turned
// into text here with std::to_string and friends, and TORCH_CHECK only sees one finished C string.
// The pieces are formatted only when the check fails.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

namespace torch_check {
// Internal linkage: each binding is one translation unit, and two extensions loaded in one
// process share no symbol.
namespace {

void append(std::string& s, const char* v) { s += v; }
void append(std::string& s, const std::string& v) { s += v; }
void append(std::string& s, int64_t v) { s += std::to_string(v); }
void append(std::string& s, int v) { s += std::to_string(v); }
void append(std::string& s, c10::IntArrayRef v) {  // "[4, 256]"
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += "]";
}
void append(std::string& s, const c10::Device& d) { s += d.str(); }
void append(std::string& s, c10::ScalarType t) { s += c10::toString(t); }
void append(std::string& s, const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  s += buf;
}

template <typename... Args>
std::string message(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

}  // namespace
}  // namespace torch_check

#define PK_CHECK(cond, ...) TORCH_CHECK(cond, ::torch_check::message(__VA_ARGS__).c_str())
