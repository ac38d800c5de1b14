"""A daemon's exit (runtime/daemon.fast_exit): the atexit handlers and the
finalizers marked for exit still run, the exit status is the one main()
returned, and torch's per-library finalizers are left out (CPU spent undoing
operator registrations in a process about to end)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import weakref

import torch.library

from hetps.runtime.daemon import skip_torch_library_teardown


def test_torch_library_finalizers_are_left_out_and_others_kept():
    class Held:
        pass

    held = Held()
    mine = weakref.finalize(held, lambda: None)
    registry = weakref.finalize._registry.values()
    assert any(info.func is torch.library._del_library and info.atexit for info in registry)
    skip_torch_library_teardown()
    assert not any(info.func is torch.library._del_library and info.atexit for info in registry)
    assert mine.atexit and mine.alive


def test_a_daemon_exit_runs_atexit_handlers_and_finalizers_and_keeps_its_status(tmp_path):
    marks = tmp_path / "marks"
    script = textwrap.dedent(
        f"""
        import atexit, weakref
        import torch
        from hetps.runtime.daemon import fast_exit

        class Held:
            pass

        held = Held()
        weakref.finalize(held, lambda: open({str(marks)!r}, "a").write("finalizer "))
        atexit.register(lambda: open({str(marks)!r}, "a").write("atexit "))
        print("flushed by the exit", end="")
        fast_exit(3)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "flushed by the exit"
    assert sorted(marks.read_text().split()) == ["atexit", "finalizer"]
