"""The CPU extension's name follows its sources: torch's builder keys its build directory by
name, so an edited kernel (or another checkout's different one) must not share a name."""
from __future__ import annotations

import os
import shutil

from folio.model import cpu_kernels


def test_extension_name_changes_with_any_source(tmp_path) -> None:
    here = os.path.join(os.path.dirname(cpu_kernels.__file__), "csrc")
    copy = tmp_path / "csrc"
    shutil.copytree(here, copy)
    name = cpu_kernels._extension_name(str(copy))
    assert name.startswith(cpu_kernels._NAME + "_")
    assert name == cpu_kernels._extension_name(here)  # the contents decide, not the path
    with open(copy / "ops.h", "a") as f:  # a header counts too
        f.write("\n// edited\n")
    assert cpu_kernels._extension_name(str(copy)) != name
