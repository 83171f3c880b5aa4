"""`python_venv`: the Python interpreter Bazel runs this project's py_* targets on.

The rule makes a virtual environment inside its own repository directory, installs
requirements.txt into it with pip, and registers that environment's interpreter as the Python
toolchain. Bazel re-runs the rule when requirements.txt changes, so nothing but a `python3` that
can make virtual environments (Debian: python3-venv) and a reachable package index is needed.

    load("//third_party/python_venv:defs.bzl", "python_venv")
    python_venv(name = "hb_python", requirements = "//:requirements.txt")
    register_toolchains("@hb_python//:toolchain")

Set HB_PYTHON to the interpreter to build the environment from (default: `python3` on PATH).
"""

_BUILD_TEMPLATE = """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{interpreter}",
    python_version = "PY3",
    # Bazel's default stub shebang asks for `python`, which Debian does not install. The stub
    # only starts `interpreter_path`, so any python3 on PATH will do.
    stub_shebang = "#!/usr/bin/env python3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
"""

def _run(repository_ctx, arguments, description, timeout):
    repository_ctx.report_progress(description)
    result = repository_ctx.execute(arguments, timeout = timeout, quiet = True)
    if result.return_code != 0:
        fail("{} failed with exit code {}:\n{}\n{}".format(
            description,
            result.return_code,
            result.stdout,
            result.stderr,
        ))

def _base_python(repository_ctx):
    python = repository_ctx.os.environ.get("HB_PYTHON", "python3")
    if "/" in python:
        return repository_ctx.path(python)
    found = repository_ctx.which(python)
    if found == None:
        fail("No `{}` on PATH to build the test virtual environment from. ".format(python) +
             "Install it (Debian: `apt-get install python3 python3-venv`, or run " +
             "testing/setup.sh), or set HB_PYTHON to an interpreter's path.")
    return found

def _python_venv_impl(repository_ctx):
    requirements = repository_ctx.path(repository_ctx.attr.requirements)
    venv = repository_ctx.path("venv")
    _run(
        repository_ctx,
        [_base_python(repository_ctx), "-m", "venv", str(venv)],
        "Creating the virtual environment",
        timeout = 600,
    )
    python = venv.get_child("bin").get_child("python3")
    _run(
        repository_ctx,
        [
            python,
            "-m",
            "pip",
            "install",
            "--no-input",
            "--progress-bar=off",
            "--requirement",
            str(requirements),
        ],
        "pip install --requirement {}".format(repository_ctx.attr.requirements),
        timeout = repository_ctx.attr.pip_timeout,
    )
    repository_ctx.file("WORKSPACE", 'workspace(name = "{}")\n'.format(repository_ctx.name))
    repository_ctx.file("BUILD.bazel", _BUILD_TEMPLATE.format(interpreter = python))

python_venv = repository_rule(
    implementation = _python_venv_impl,
    attrs = {
        # A label, so that Bazel re-runs the rule whenever the file's contents change.
        "requirements": attr.label(allow_single_file = True, mandatory = True),
        "pip_timeout": attr.int(
            default = 3600,
            doc = "Seconds pip may take to install the requirements.",
        ),
    },
    environ = ["HB_PYTHON"],
    doc = "A virtual environment with `requirements` installed, as a Python toolchain.",
)
