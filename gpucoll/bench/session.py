"""One rank of a benchmark job: join the group, run the sweep, and (rank 0) report.

Rank 0 prints nccl-tests' header and table as rows finish, the footer, and writes
``--json``/``--csv``/``--plot``. On a terminal it also shows which measurement is
running on a transient status line (stderr); elsewhere the table's own
line per size is the progress.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Sequence, TextIO, cast

from .arrays import ArrayKit, make_kit
from .options import BenchConfig
from .runner import RankInfo, Row, check_config, rank_info, run_rank

__all__ = ["run_session", "run_in_group"]


class _Progress:
    """A status line on a terminal, rewritten in place and cleared before each table row."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._shown = False
        self._t0 = time.monotonic()

    def update(self, text: str) -> None:
        if self._tty:
            self._stream.write(f"\r\033[K# [{time.monotonic() - self._t0:6.1f} s] running {text}")
            self._stream.flush()
            self._shown = True

    def clear(self) -> None:
        if self._shown:
            self._stream.write("\r\033[K")
            self._stream.flush()
            self._shown = False


def _print(lines: Sequence[str]) -> None:
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    sys.stdout.flush()


def run_session(cfg: BenchConfig, argv: Sequence[str], *, json_path: str | None = None,
                csv_path: str | None = None, plot_path: str | None = None) -> int:
    """Run ``cfg`` as this process's rank of the job its environment describes.

    Args:
        cfg: what to measure (backend already resolved).
        argv: the command line, recorded in the report.
        json_path, csv_path, plot_path: files rank 0 writes.

    Returns:
        1 on rank 0 when a check found wrong elements, else 0.
    """
    import gpucoll

    from ..clusters import detect

    found = detect()
    if found is not None:
        check_config(cfg, found.world_size)
    # The device is chosen before the group exists: NCCL binds a communicator to the current device.
    kit = make_kit(cfg.backend, found.local_rank if found is not None else 0)
    device = getattr(kit, "device", None) if cfg.backend == "nccl" else None
    gpucoll.init_process_group(backend=cfg.backend, timeout=cfg.timeout, device_id=device)
    try:
        return run_in_group(cfg, argv, kit, json_path=json_path, csv_path=csv_path, plot_path=plot_path)
    finally:
        gpucoll.destroy_process_group()


def run_in_group(cfg: BenchConfig, argv: Sequence[str], kit: ArrayKit, *, json_path: str | None = None,
                 csv_path: str | None = None, plot_path: str | None = None) -> int:
    """The benchmark on the default group, already initialised, with ``kit``'s buffers:
    rank 0 prints the header, the rows and the footer, and writes the files.

    Returns:
        1 on rank 0 when a check found wrong elements, else 0.
    """
    import gpucoll

    from .report import (
        document, environment, footer_lines, format_row, header_lines, table_header, wrong_entries,
        write_csv, write_json,
    )

    rank, n = gpucoll.get_rank(), gpucoll.get_world_size()
    gathered: list[Any] = [None] * n
    gpucoll.all_gather_object(gathered, rank_info(kit))
    infos = cast("list[RankInfo]", gathered)
    lead = rank == 0
    env = environment(cfg, n, kit.device_name(), argv)
    progress = _Progress(sys.stderr)
    if lead:
        _print(header_lines(cfg, env, infos) + table_header())

    def on_row(row: Row) -> None:
        progress.clear()
        _print([format_row(row)])

    rows = run_rank(cfg, on_row=on_row if lead else None,
                    on_progress=progress.update if lead else None, kit=kit)
    if not lead:
        return 0
    _print(footer_lines(rows))
    doc = document(cfg, env, infos, rows)
    if json_path:
        write_json(json_path, doc)
    if csv_path:
        write_csv(csv_path, doc)
    if plot_path:
        from .plot import plot_runs, run_label

        plot_runs([(run_label(doc), doc)], plot_path)
    return 1 if wrong_entries(rows) else 0
