"""Build macros for the target shapes haiku_bridge repeats.

Each macro adds only what every such target shares (default `srcs` from the name, Python 3, the
example's three targets) and passes everything else to Bazel's own rule as it is: `size`,
`shard_count`, `env`, `args`, `tags`, `data`, `testonly`, `visibility`... mean what Bazel's
documentation says.

Python packages from requirements.txt (jax, haiku, absl, chex, numpy) are not Bazel targets: every
target runs on the interpreter of @hb_python (see WORKSPACE), which has them all installed. `deps`
list only this repository's targets.

    load("//bazel:defs.bzl", "hb_py_binary", "hb_py_library", "hb_py_test")

    hb_py_library(name = "call_pure", deps = [":naming"])

    hb_py_test(name = "call_pure_test", size = "medium", deps = [":call_pure"])

    hb_py_binary(name = "benchmark", testonly = True, deps = [":benchmark_lib"])
"""

# py_test attributes that py_library and py_binary do not have.
_TEST_ONLY_ATTRS = ["size", "timeout", "shard_count", "flaky", "local"]

def hb_py_library(name, srcs = None, **kwargs):
    """A py_library for one module, `<name>.py` unless `srcs` says otherwise.

    Args:
      name: target name; also the module's file name without `.py`.
      srcs: source files; default `[name + ".py"]`.
      **kwargs: passed on to py_library (`deps`, `testonly`, `visibility`...).
    """
    native.py_library(
        name = name,
        srcs = srcs or [name + ".py"],
        srcs_version = "PY3",
        **kwargs
    )

def hb_py_test(name, srcs = None, **kwargs):
    """A py_test for one absltest file, `<name>.py` unless `srcs` says otherwise.

    `size` sets Bazel's timeout: "small" is 60 s, "medium" 300 s, "large" 900 s. Here it defaults to
    "small" (Bazel's own default is "medium"), so that a test which grew slow says so. Give a slow
    test a larger size and a `shard_count`: absltest splits its test methods among the shards, which
    Bazel runs in parallel.

    Args:
      name: target name; also the test file's name without `.py`.
      srcs: source files; default `[name + ".py"]`, which is also the test's main file.
      **kwargs: passed on to py_test (`deps`, `size`, `shard_count`, `args`, `tags`, `data`...).
    """
    kwargs.setdefault("size", "small")
    native.py_test(
        name = name,
        srcs = srcs or [name + ".py"],
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )

def hb_py_binary(name, srcs = None, **kwargs):
    """A py_binary for one program, `<name>.py` unless `srcs` says otherwise (`bazel run`).

    Its main file is `<name>.py`, as Bazel's default.

    Args:
      name: target name; also the program's file name without `.py`.
      srcs: source files; default `[name + ".py"]`.
      **kwargs: passed on to py_binary (`deps`, `data`, `testonly`, `args`...).
    """
    native.py_binary(
        name = name,
        srcs = srcs or [name + ".py"],
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )

def hb_py_example(name, args = [], test_args = None, **kwargs):
    """A runnable example `<name>.py`, as three targets.

    - `<name>`: a py_binary, for `bazel run //examples:<name>`.
    - `<name>_lib`: a py_library of the same file, for a test file that imports the example
      (`<name>_test.py`, which gets its own `hb_py_test`).
    - `<name>_main_test`: a py_test that runs the example's main to the end, so that
      `bazel test //...` checks that `bazel run` works.

    Args:
      name: target name; also the example's file name without `.py`.
      args: command-line arguments for the binary and the main test.
      test_args: arguments for `<name>_main_test` instead of `args`, e.g. fewer steps.
      **kwargs: passed on to all three targets (`deps`, `tags`, `visibility`...), except the
        test-only attributes (`size`, default "small" as for `hb_py_test`; `timeout`,
        `shard_count`, `flaky`, `local`), which go to `<name>_main_test` only.
    """
    test_only = {"size": "small"}
    for attr in _TEST_ONLY_ATTRS:
        if attr in kwargs:
            test_only[attr] = kwargs.pop(attr)
    src = name + ".py"
    native.py_library(
        name = name + "_lib",
        srcs = [src],
        srcs_version = "PY3",
        **kwargs
    )
    native.py_binary(
        name = name,
        srcs = [src],
        main = src,
        args = args,
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )
    native.py_test(
        name = name + "_main_test",
        srcs = [src],
        main = src,
        args = args if test_args == None else test_args,
        python_version = "PY3",
        srcs_version = "PY3",
        **dict(kwargs, **test_only)
    )
