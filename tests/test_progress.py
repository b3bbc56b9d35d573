"""Progress of long work: a bar with its rate and ETA on a terminal, nothing on a pipe or a file
(CI logs stay clean), nothing with --quiet (lalr_lightning.progress and the commands that use it)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lalr_lightning import progress
from tests._lm import save_tiny_lm

ROOT = Path(__file__).resolve().parents[1]
RATE_AND_ETA = re.compile(r"\[\d\d:\d\d<\d\d:\d\d, [\d.]+k?(tok|block|matrix)/s\]")


class _Terminal(io.StringIO):
    """stderr as a terminal would be: tqdm draws on it."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def redraw_every_update(monkeypatch):
    # tqdm redraws at most every 0.1 s; a tiny model finishes sooner, so the rate would never show
    monkeypatch.setattr(progress, "MININTERVAL", 0)
    progress.set_quiet(False)
    yield
    progress.set_quiet(False)


@pytest.mark.smoke
def test_a_bar_on_a_terminal_none_on_a_pipe_none_when_quiet(redraw_every_update):
    for stream, drawn in ((_Terminal(), True), (io.StringIO(), False)):
        for _ in progress.bar(range(3), desc="blocks", unit="block", stream=stream):
            pass
        assert bool(stream.getvalue()) is drawn, stream.getvalue()
    tty = _Terminal()
    with progress.quiet():
        assert not progress.enabled(tty)
        list(progress.bar(range(3), stream=tty))
    assert tty.getvalue() == "" and progress.enabled(tty)
    plain = io.StringIO()
    progress.write("block 1/2 pruned", plain)
    assert plain.getvalue() == "block 1/2 pruned\n"


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    (root / "text.txt").write_text(" ".join(["the cat sees the dog ."] * 120))
    return root, save_tiny_lm(root / "llama", "llama", False)


def _command(main, argv, monkeypatch, stream) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    assert main(argv) == 0
    return stream.getvalue()


@pytest.mark.smoke
@pytest.mark.parametrize("quiet", [False, True])
def test_perplexity_and_wanda_show_rate_and_eta_on_a_terminal(lm, tmp_path, monkeypatch, redraw_every_update, quiet):
    from lalr_lightning.oneshot.commands import perplexity_main, prune_main

    root, model = lm
    flag = ["--quiet"] if quiet else []
    err = _command(perplexity_main, [str(model), "--data", str(root / "text.txt"), "--seq-len", "16", *flag],
                   monkeypatch, _Terminal())
    assert bool("perplexity:" in err and RATE_AND_ETA.search(err)) is not quiet, err
    assert not quiet or err == "", err
    err = _command(prune_main, [str(model), "--out", str(tmp_path / "pruned"), "--criterion", "wanda",
                                "--calibration", str(root / "text.txt"), "--n-samples", "2", "--seq-len", "16",
                                "--preset", "alphapruning", *flag], monkeypatch, _Terminal())
    shown = "calibrating blocks:" in err and "HT-SR metrics:" in err and RATE_AND_ETA.search(err)
    assert bool(shown) is not quiet, err
    assert "block 2/2 pruned" in err  # the per-block lines are still there, above the bar


def test_no_bar_when_stderr_is_a_file(lm, tmp_path, monkeypatch, redraw_every_update):
    from lalr_lightning.oneshot.commands import prune_main

    root, model = lm
    err = _command(prune_main, [str(model), "--out", str(tmp_path / "pruned"), "--criterion", "sparsegpt",
                                "--calibration", str(root / "text.txt"), "--n-samples", "2", "--seq-len", "16"],
                   monkeypatch, io.StringIO())
    assert "\r" not in err and "calibrating" not in err and "block 2/2 pruned" in err, err


def test_analyze_of_a_directory_in_a_real_pseudo_terminal_and_redirected(lm, tmp_path, monkeypatch,
                                                                        redraw_every_update):
    """The command as a user runs it, under a pseudo-terminal: it draws the bar; with stderr
    redirected (CI, a log file; in this process, to save a start-up) there is no bar."""
    pty = pytest.importorskip("pty")
    root, model = lm
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TQDM_MININTERVAL="0", OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "lalr_lightning", "analyze", str(model), "--no-plots"]
    import fcntl
    import struct
    import termios

    primary, secondary = pty.openpty()
    # a new pseudo-terminal is 0 columns wide, where tqdm draws an empty bar: give it a terminal's size
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    seen = b""
    try:
        done = subprocess.Popen([*argv, "--out", str(tmp_path / "a")], stdout=subprocess.DEVNULL, stderr=secondary,
                                env=env)
        os.close(secondary)  # the child holds the terminal's other end; reading ends when it exits
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        done.wait(timeout=300)
    finally:
        os.close(primary)
    assert done.returncode == 0
    assert b"spectral analysis:" in seen and RATE_AND_ETA.search(seen.decode(errors="replace")), seen[-2000:]
    from lalr_lightning.cli import analyze_main

    err = _command(analyze_main, [str(model), "--no-plots", "--out", str(tmp_path / "b")], monkeypatch, io.StringIO())
    assert "spectral analysis:" not in err and "\r" not in err, err
