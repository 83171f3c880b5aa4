"""Build macros for the target shapes haiku_bridge repeats.

Python packages from requirements.txt (jax, haiku, absl, chex, numpy) are not Bazel targets: every
target runs on the interpreter of @hb_python (see WORKSPACE), which has them all installed. `deps`
list only this repository's targets.

    load("//testing:build_defs.bzl", "hb_py_library", "hb_py_test")

    hb_py_library(name = "call_pure", deps = [":naming"])

    hb_py_test(name = "call_pure_test", deps = [":call_pure", "//testing:test_utils"])
"""

def hb_py_library(name, srcs = None, deps = [], **kwargs):
    """A py_library for one module, `<name>.py` unless `srcs` says otherwise.

    Args:
      name: target name; also the module's file name without `.py`.
      srcs: source files; default `[name + ".py"]`.
      deps: this repository's py_library targets that the module imports.
      **kwargs: passed on to py_library, e.g. `testonly` or `visibility`.
    """
    native.py_library(
        name = name,
        srcs = srcs or [name + ".py"],
        deps = deps,
        srcs_version = "PY3",
        **kwargs
    )

def hb_py_test(
        name,
        srcs = None,
        deps = [],
        size = "small",
        shard_count = None,
        env = {},
        args = [],
        tags = [],
        **kwargs):
    """A py_test for one absltest file, `<name>.py` unless `srcs` says otherwise.

    Sizes set Bazel's timeout: "small" (the default) is 60 s, "medium" 300 s, "large" 900 s. Give a
    slow test a larger size and a `shard_count`: absltest splits its test methods among the shards,
    which Bazel runs in parallel.

    Args:
      name: target name; also the test file's name without `.py`.
      srcs: source files; default `[name + ".py"]`, which is also the test's main file.
      deps: this repository's targets that the test imports.
      size: Bazel test size: "small", "medium", "large" or "enormous".
      shard_count: number of parallel shards, for slow tests.
      env: environment variables for the test, e.g. `{"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}`.
      args: command-line arguments for the test.
      tags: Bazel tags, e.g. ["manual"] to leave the test out of `bazel test //...`.
      **kwargs: passed on to py_test.
    """
    native.py_test(
        name = name,
        srcs = srcs or [name + ".py"],
        deps = deps,
        size = size,
        shard_count = shard_count,
        env = env,
        args = args,
        tags = tags,
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )

def hb_py_example(name, deps = [], args = [], test_args = None, size = "small", **kwargs):
    """A runnable example `<name>.py`, as three targets.

    - `<name>`: a py_binary, for `bazel run //examples:<name>`.
    - `<name>_lib`: a py_library of the same file, for a test file that imports the example
      (`<name>_test.py`, which gets its own `hb_py_test`).
    - `<name>_main_test`: a py_test that runs the example's main to the end, so that
      `bazel test //...` checks that `bazel run` works.

    Args:
      name: target name; also the example's file name without `.py`.
      deps: this repository's targets that the example imports.
      args: command-line arguments for the binary and the main test.
      test_args: arguments for `<name>_main_test` instead of `args`, e.g. fewer steps.
      size: Bazel test size of `<name>_main_test`.
      **kwargs: passed on to all three targets.
    """
    src = name + ".py"
    native.py_library(
        name = name + "_lib",
        srcs = [src],
        deps = deps,
        srcs_version = "PY3",
        **kwargs
    )
    native.py_binary(
        name = name,
        srcs = [src],
        main = src,
        deps = deps,
        args = args,
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )
    native.py_test(
        name = name + "_main_test",
        srcs = [src],
        main = src,
        deps = deps,
        args = args if test_args == None else test_args,
        size = size,
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )
