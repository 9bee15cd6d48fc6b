"""Does an error raised inside a C++ CPU extension reach Python as RuntimeError on this host, or
crash the process? (On the H200 host, torch 2.11 / Python 3.12, folio's paged-attention range
check crashed the test process with SIGSEGV instead of raising.) Each probe runs in its own
process: its exit status and last line are printed."""
from __future__ import annotations

import subprocess
import sys


def _minimal_extension(name: str, *bodies: str) -> str:
    """A probe building an extension of ATen and torch's pybind header alone, with one
    function per body (boom0, boom1, ...), each called once."""
    functions = "".join(f"void boom{i}(at::Tensor x) {{ {b} }}\\n" for i, b in enumerate(bodies))
    defs = " ".join(f'm.def("boom{i}", &boom{i});' for i in range(len(bodies)))
    return f"""
import os, tempfile, torch
from torch.utils.cpp_extension import load
d = tempfile.mkdtemp()
open(os.path.join(d, "b.cpp"), "w").write(
    '#include <ATen/core/Tensor.h>\\n#include <torch/csrc/utils/pybind.h>\\n'
    '{functions}'
    'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ {defs} }}\\n')
m = load("{name}", sources=[os.path.join(d, "b.cpp")], verbose=False)
for i in reversed(range({len(bodies)})):
    try:
        getattr(m, f"boom{{i}}")(torch.zeros(3))
    except RuntimeError as exc:
        print("RuntimeError:", str(exc).splitlines()[0])
"""


PROBES = {
    "folio q4_matmul bad shape (TORCH_CHECK)": """
import torch
from folio.model.cpu_kernels import extension
e = extension()
try:
    e.q4_matmul(torch.zeros(1, 33), torch.zeros(1, 2, 16, dtype=torch.uint8),
                torch.zeros(1, 2, 1), torch.zeros(1, 2, 1))
except RuntimeError as exc:
    print("RuntimeError:", str(exc).splitlines()[0])
""",
    "inline torch/extension.h TORCH_CHECK": """
import torch
from torch.utils.cpp_extension import load_inline
src = '#include <torch/extension.h>\\nvoid boom(at::Tensor x) { TORCH_CHECK(false, \\"boom\\"); }\\n'
m = load_inline("diag_ext_full", cpp_sources=[src], functions=["boom"], verbose=False)
try:
    m.boom(torch.zeros(1))
except RuntimeError as exc:
    print("RuntimeError:", str(exc).splitlines()[0])
""",
    "inline ATen + utils/pybind.h TORCH_CHECK": _minimal_extension(
        "diag_ext_min", 'TORCH_CHECK(false, "boom");',
        'throw std::runtime_error("boom_std");'),
    # session 19: folio's rotary range check crashed on an H100 host where the checks above
    # raised; its message is formatted (a number in it), theirs are plain strings
    "folio rotary position out of range (formatted TORCH_CHECK)": """
import torch
from folio.model.cpu_kernels import extension
e = extension()
q = torch.zeros(2, 1, 8)
try:
    e.rotary_neox(torch.tensor([0, 99]), q, q, torch.zeros(4, 8), torch.zeros(4, 8), 8)
except RuntimeError as exc:
    print("RuntimeError:", str(exc).splitlines()[0])
""",
    "inline ATen + utils/pybind.h formatted TORCH_CHECK": _minimal_extension(
        "diag_ext_fmt", 'TORCH_CHECK(false, "boom ", x.size(0), " formatted");'),
}

for name, code in PROBES.items():
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    last = (r.stdout.strip().splitlines() or [""])[-1] if r.returncode == 0 else \
        (r.stderr.strip().splitlines() or [""])[-1]
    print(f"{name}: exit {r.returncode}; {r.stdout.strip()[-300:] or last[-300:]}", flush=True)
