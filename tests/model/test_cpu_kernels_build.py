"""The CPU extension's name follows its sources and checkout: torch's builder keys its build
directory by name, so an edited kernel (or another checkout, whose include path differs) must
not share a name."""
from __future__ import annotations

import os
import shutil

from folio.model import cpu_kernels


def test_extension_name_changes_with_any_source_and_checkout(tmp_path) -> None:
    here = os.path.join(os.path.dirname(cpu_kernels.__file__), "csrc")
    copy = tmp_path / "csrc"
    shutil.copytree(here, copy)
    name = cpu_kernels._extension_name(str(copy))
    assert name.startswith(cpu_kernels._NAME + "_")
    assert name == cpu_kernels._extension_name(str(copy))
    # the same sources in another checkout: its own build (the include path differs)
    assert name != cpu_kernels._extension_name(here)
    with open(copy / "ops.h", "a") as f:  # a header counts too
        f.write("\n// edited\n")
    assert cpu_kernels._extension_name(str(copy)) != name


def test_a_build_killed_midway_does_not_hang_the_next_start(tmp_path) -> None:
    """A builder killed while it held the directory leaves torch's `lock` file behind (torch's
    builder would then wait for it forever); the next build clears it, because the flock the
    dead builder held was released with it."""
    import signal
    import subprocess
    import sys
    build_dir = str(tmp_path / "build")
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from folio.model import cpu_kernels\n"
         f"with cpu_kernels._build_lock({build_dir!r}):\n"
         f"    open({build_dir!r} + '/lock', 'w').close()  # torch's baton, as its builder makes it\n"
         "    print('building', flush=True)\n"
         "    time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "building"
        assert os.path.exists(os.path.join(build_dir, "lock"))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    with cpu_kernels._build_lock(build_dir):
        assert not os.path.exists(os.path.join(build_dir, "lock"))
