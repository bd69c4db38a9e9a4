"""gpucoll-run: start a gpucoll job on this node (``python -m gpucoll.run`` works too).

::

    gpucoll-run --nproc-per-node 4 train.py --epochs 3
    gpucoll-run --nproc-per-node gpu -m mypackage.train
    gpucoll-run --nnodes 2 --node-rank 0 --master-addr node01 --master-port 29500 train.py

The launcher serves the job's TCPStore (ranks connect as clients, presenting a
per-job token), starts the ranks with RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT set, so that
``gpucoll.init_process_group()`` needs no arguments, prefixes their output with
``[rank<N>]: ``, and stops every rank as soon as one fails. See docs/launching.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Mapping, Sequence

from ._launch.agent import run_job
from ._launch.binding import BIND_CHOICES
from ._launch.config import LaunchConfig, resolve_nproc, resolve_relay, resolve_token

__all__ = ["main", "build_config"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run gpucoll-run with ``argv`` (``sys.argv[1:]`` when None); return the exit status.

    Args:
        argv: the command line, without the program name.

    Returns:
        0 when every rank succeeded; the failed rank's exit code (128 + N for a
        signal N); 128 + N when the launcher itself got signal N; 2 for a bad
        command line; 1 when the job's store could not be served or reached.

    Example:
        >>> main(["--nproc-per-node", "2", "train.py"])  # doctest: +SKIP
        0
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        config = build_config(args, os.environ)
        _check_script(args)
    except ValueError as err:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    return run_job(config)


def build_config(args: argparse.Namespace, environ: Mapping[str, str]) -> LaunchConfig:
    """Validate parsed arguments into a LaunchConfig.

    Raises:
        ValueError: an argument is out of range or conflicts with another; the message
            names the option, its value and what was expected.
    """
    standalone = bool(args.standalone)
    if standalone:
        for name, value in (("--nnodes", args.nnodes), ("--node-rank", args.node_rank),
                            ("--master-addr", args.master_addr), ("--master-port", args.master_port)):
            if value is not None:
                raise ValueError(f"--standalone runs one node on a free local port; it cannot be combined "
                                 f"with {name} {value}")
    nnodes = 1 if args.nnodes is None else args.nnodes
    node_rank = 0 if args.node_rank is None else args.node_rank
    port = 0 if args.master_port is None else args.master_port
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1; got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in [0, --nnodes={nnodes}); got {node_rank}")
    if not 0 <= port <= 65535:
        raise ValueError(f"--master-port must be a TCP port in 0..65535 (0: pick a free one); got {port}")
    if nnodes > 1 and not args.master_addr:
        raise ValueError(f"--nnodes {nnodes} needs --master-addr: the address of node 0, reachable from every node")
    if nnodes > 1 and node_rank > 0 and port == 0:
        raise ValueError(f"--node-rank {node_rank} needs --master-port: the port node 0's launcher serves "
                         "the store on (it prints it when started with --master-port 0)")
    if args.tee and not args.log_dir:
        raise ValueError("--tee copies the ranks' output to the console as well as to --log-dir; give --log-dir")
    if not args.grace_period > 0:
        raise ValueError(f"--grace-period must be > 0 seconds; got {args.grace_period}")
    if not args.join_timeout > 0:
        raise ValueError(f"--join-timeout must be > 0 seconds; got {args.join_timeout}")
    nproc = resolve_nproc(args.nproc_per_node, environ)
    program = (("-m",) if args.module else ()) + (args.script, *args.script_args)
    return LaunchConfig(
        program=program,
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=args.master_addr or "127.0.0.1",
        master_port=port,
        token=resolve_token(environ, nnodes),
        log_dir=os.path.abspath(args.log_dir) if args.log_dir else None,
        tee=bool(args.tee),
        prefix=not args.no_prefix and nnodes * nproc > 1,
        grace_period=float(args.grace_period),
        join_timeout=float(args.join_timeout),
        store_relay=resolve_relay(args.store_relay, nnodes, nproc),
        bind_to=args.bind_to,
    )


def _version() -> str:
    from . import __version__

    return __version__


def _check_script(args: argparse.Namespace) -> None:
    """A script that is not there fails here, once, instead of on every rank."""
    if args.module or os.path.isfile(args.script):
        return
    what = "is a directory" if os.path.isdir(args.script) else "does not exist"
    raise ValueError(f"script {args.script!r} {what} (looked in {os.getcwd()}); give the path of a "
                     "Python file, or -m MODULE to run a module")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpucoll-run",
        description="Start a gpucoll job: one process per rank on this node, with the job's store, "
                    "rank variables, prefixed output and fail-fast supervision.",
        epilog="Environment: GPUCOLL_STORE_TOKEN (required with --nnodes > 1) is the store's shared secret.",
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="1", metavar="N|gpu|cpu|auto",
                   help="ranks on this node: a number, 'gpu' (one per GPU), 'cpu' (one per core), "
                        "'auto' (one per GPU, or 1 without GPUs). Default: 1")
    p.add_argument("--nnodes", type=int, default=None, help="number of nodes (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=None,
                   help="this node's index in [0, nnodes) (default 0)")
    p.add_argument("--master-addr", "--master_addr", default=None,
                   help="address of node 0, where the job's store runs (default 127.0.0.1; "
                        "required with --nnodes > 1)")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="port of the job's store; 0 (default) picks a free port on node 0")
    p.add_argument("--standalone", action="store_true",
                   help="one node, store on a free local port (the default without --nnodes)")
    p.add_argument("-m", "--module", action="store_true",
                   help="run SCRIPT as a module, like python -m")
    p.add_argument("--log-dir", "--log_dir", default=None,
                   help="write each rank's output to LOG_DIR/rank<N>.log (and its error file there)")
    p.add_argument("--tee", action="store_true",
                   help="with --log-dir, show the output on the console as well")
    p.add_argument("--no-prefix", action="store_true",
                   help="do not prefix console lines with [rank<N>]: (the default with more than one rank)")
    p.add_argument("--grace-period", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    p.add_argument("--join-timeout", type=float, default=300.0,
                   help="seconds to wait for node 0's store, or on node 0 for the other nodes to "
                        "finish (default 300)")
    p.add_argument("--store-relay", choices=("auto", "on", "off"), default="auto",
                   help="serve this node's ranks' store traffic through a relay in the launcher, over one "
                        "connection to the job's store (auto, the default: on with --nnodes > 1 and at least "
                        "32 ranks per node; see docs/launching.md)")
    p.add_argument("--bind-to", "--bind_to", choices=BIND_CHOICES, default="none",
                   help="bind each local rank to a core of its own, as mpirun does ('core'), or not ('none', "
                        "the default, as torchrun); with more local ranks than cores nothing is bound "
                        "(see docs/launching.md)")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    p.add_argument("script", metavar="SCRIPT", help="the program: a Python file, or a module with -m")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="its arguments")
    return p


if __name__ == "__main__":
    sys.exit(main())
