"""Offline stand-in for @rules_cc//cc:defs.bzl: each rule forwards to Bazel's built-in one.

Bazel 4.2.3 fetches rules_cc from the internet only because BUILD files inside @bazel_tools load
their C++ rules from it; this project builds no C++. Debian's `bazel-rules-cc` package cannot take
its place: it is newer than Bazel 4.2.3 understands (it calls `use_cpp_toolchain`).
testing/setup.sh points Bazel at this directory with `--override_repository=rules_cc=...`.
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def fdo_prefetch_hints(**attrs):
    native.fdo_prefetch_hints(**attrs)

def fdo_profile(**attrs):
    native.fdo_profile(**attrs)

def objc_import(**attrs):
    native.objc_import(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)
