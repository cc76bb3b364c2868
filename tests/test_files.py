"""Outputs are whole or absent: an interrupt (KeyboardInterrupt, as Ctrl-C raises) in the middle of writing a report,
a PNG or a JSON leaves no partial file and no temporary file in the output folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from multihead.files import atomic_path, save_figure, write_text


def test_an_interrupted_write_leaves_nothing_and_a_finished_one_replaces_whole(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as partial:
        partial.write_text('{"half": ')
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    write_text(target, '{"whole": 1}')
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as partial:
        partial.write_text('{"half": ')
        raise KeyboardInterrupt
    assert target.read_text() == '{"whole": 1}' and list(tmp_path.iterdir()) == [target]  # the old one stays


@pytest.mark.slow
def test_ctrl_c_while_the_heads_report_is_written_leaves_only_whole_files(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The real report writer, interrupted inside matplotlib's savefig of the second PNG after it wrote some bytes."""
    import matplotlib.figure

    from multihead.heads.adapters import load_head_model
    from multihead.heads.analysis import analyse
    from multihead.heads.report import write_all

    report = analyse(load_head_model("minilm"), "The cat sat on the mat.", progress=False)
    real = matplotlib.figure.Figure.savefig
    calls = []

    def interrupted(self, fname, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(fname)
        if len(calls) == 2:
            Path(fname).write_bytes(b"\x89PNG half")
            raise KeyboardInterrupt
        return real(self, fname, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_all(report, tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["heads-grid.png", "report.html"], names  # whole files written before the interrupt, nothing else
    assert (tmp_path / "heads-grid.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "report.html").read_text().rstrip().endswith("</html>")


def test_a_figure_keeps_the_targets_format(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    assert save_figure(fig, tmp_path / "a.svg").read_text().lstrip().startswith("<?xml")
    assert save_figure(fig, tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    plt.close(fig)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "a.svg"]
