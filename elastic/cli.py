"""The ``elastic`` command line. Each sub-command is a thin layer over the SDK."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .errors import ElasticError, InterruptedJobError

__all__ = ["main"]


def _parse_sets(pairs: list[str]) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise SystemExit(f"--set expects key=value, got {p!r}")
        k, _, v = p.partition("=")
        try:
            out[k.strip()] = yaml.safe_load(v)
        except yaml.YAMLError as e:  # (its value is not echoed: it may hold a credential)
            mark = getattr(e, "problem_mark", None)
            where = f" at column {mark.column + 1}" if mark is not None else ""
            raise SystemExit(f"elastic: --set {k.strip()}=...: the value is not YAML "
                             f"({getattr(e, 'problem', None) or type(e).__name__}{where}). "
                             "Fix: quote it, or close what it opens") from None
    return out


def _cmd_run(a: argparse.Namespace) -> int:
    from .api import fit
    from .config import JobConfig

    sets = _parse_sets(a.set or [])
    if a.view:
        sets["view"] = a.view
    cfg = JobConfig.from_yaml(a.job, sets)  # checked once, with the overrides
    result = fit(cfg)
    print(f"[elastic] done: {len(result.history)} steps, final loss {result.final_loss:.4f}, "
          f"run directory {result.run_dir}")
    if cfg.sample_prompt:
        from .demo import sample_text

        print("\nsample:\n" + sample_text(cfg, result.state_dict(), cfg.sample_prompt))
    if result.unsaved:  # the final state is all that holds the last steps: kept on disk
        return _kept_final(result)
    return 0


def _kept_final(result: Any) -> int:
    """A run whose last checkpoint was not committed: its final state written to the run
    directory (``final_state.pt``, the canonical entries: ``model/...`` and ``optim/...``),
    said on stderr; exit 1. Was: "done", exit 0, and the steps since the newest committed
    checkpoint lost with the driver (found by a new user, session 47)."""
    import torch

    path = os.path.join(result.run_dir, "final_state.pt")
    try:
        torch.save(result.final_state, path)
        kept = f"the final state is in {path} (torch.load it; model/* are the parameters)"
    except Exception as e:  # noqa: BLE001 - said: nothing else holds it
        kept = f"writing the final state to {path} failed too ({type(e).__name__}: {e})"
    print(f"elastic: warning: {result.unsaved}; {kept}", file=sys.stderr)
    return 1


def _cmd_demo(a: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(chaos=a.chaos, max_steps=a.steps, num_workers=a.workers,
                    strategy=a.strategy, view=a.view, run_dir=a.run_dir)


def _plain_signals() -> None:
    """After connecting, SIGTERM ends a command that trains nothing (queue watch, status...)
    quietly and Ctrl-C raises KeyboardInterrupt, as before Ray installed its fatal-signal
    handler, which prints a stack dump."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _attach(address: str | None) -> None:
    from .errors import ClusterError
    from .ray_connect import attach

    addr = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        attach(addr, namespace="elastic")
        _plain_signals()
    except ClusterError as e:  # (any other refusal, a token's, says its own fix)
        if addr != "auto" or "Could not find any running Ray instance" not in str(e):
            raise
        raise ClusterError("no Ray cluster runs on this machine to attach to. Fix: start one "
                           "with `ray start --head`, or pass --address (or set RAY_ADDRESS) "
                           "to a running cluster's address.") from None


def _cmd_status(a: argparse.Namespace) -> int:
    import json

    import ray

    from . import control

    _attach(a.address)
    if not a.job:
        jobs = control.list_jobs()
        print("\n".join(jobs) if jobs else "no elastic job is running")
        return 0
    st = ray.get(control.lookup(a.job).get_status.remote())
    print(json.dumps(st, indent=2, default=str))
    return 0


def _cmd_request(kind: str):
    def run(a: argparse.Namespace) -> int:
        import json

        from . import control

        _attach(a.address)
        value = getattr(a, "value", None)
        out = control.ask(a.job, kind, value, reason=f"{kind} requested from the CLI")
        print(json.dumps(out, indent=2, default=str))
        return 0

    return run


def _cmd_drain(a: argparse.Namespace) -> int:
    import json

    from . import control

    _attach(a.address)
    out = control.ask(a.job, "evacuate", {"node": a.node, "deadline_s": a.deadline},
                      reason="maintenance drain requested from the CLI")
    print(json.dumps(out, indent=2, default=str))
    return 0


def _cmd_plan(a: argparse.Namespace) -> int:
    """Ranked plans for a cluster file (or the live Ray cluster) and a job's model, with what
    each costs per hour and per 1,000 steps (the cluster file's or catalog's prices, or
    ``--prices``)."""
    from clusters import example_path, format_plan_table, load_cluster, plan
    from clusters.inventory import cluster_from_ray_nodes
    from clusters.prices import parse_prices, with_prices

    from .config import JobConfig
    from .planning import model_profile, tokens_per_sample

    cfg = JobConfig.from_yaml(a.job)
    model, meta = _plan_model(cfg)
    if a.cluster == "live":
        import ray

        _attach(a.address)
        cluster = cluster_from_ray_nodes(ray.nodes())
    else:
        path = a.cluster if os.path.exists(a.cluster) else example_path(a.cluster)
        if not os.path.exists(path):
            shipped = sorted(f[:-5] for f in os.listdir(os.path.dirname(example_path("x")))
                             if f.endswith(".yaml"))
            raise SystemExit(f"elastic: --cluster {a.cluster}: no such file, and no shipped "
                             f"example of that name. Fix: a cluster file's path, live, or one "
                             f"of {', '.join(shipped)}")
        cluster = load_cluster(path)
    if a.prices:
        cluster = with_prices(cluster, parse_prices(a.prices))
    tokens, sample = 1, None
    if cfg.dataset_format == "ray":  # a Ray pipeline is not run to plan
        print("elastic plan: dataset_format: ray: the pipeline is not run to plan, so a sample "
              "counts as one token (sequence models' compute is under-counted) and "
              "activations are not counted", file=sys.stderr)
    else:
        ds = cfg.dataset_object()
        tokens, sample = tokens_per_sample(ds), _plan_sample(ds, meta)
    profile = model_profile(model, cfg.optimizer, tokens, precision=cfg.precision,
                            sample=sample)
    if sample is not None and profile.activation_bytes is None:
        print("elastic plan: the model's forward could not be counted on a sample (on the "
              "meta device: data-dependent control flow?): compute is estimated as 6 x "
              "parameters x tokens per sample, and activations are not counted",
              file=sys.stderr)
    result = plan(cluster, profile, cfg.global_batch_size if a.global_batch is None
                  else a.global_batch)  # (0 is refused as the planner refuses -4)
    print(format_plan_table(result, cluster=cluster))
    return 0 if result.choice is not None else 1


def _plan_model(cfg: Any) -> tuple[Any, bool]:
    """The job's model to plan with: on the meta device (shapes, no memory: a 7B model
    would not fit this host's RAM), where its factory builds there; else as every worker
    builds it. Returns it and whether it is on meta."""
    import torch

    from .control.preflight import built_model
    from .reference import build_model

    rng = torch.get_rng_state()
    try:
        with torch.device("meta"):
            model = build_model(cfg.model_factory(), cfg.seed)
        if all(t.is_meta for t in (*model.parameters(), *model.buffers())):
            return model, True
    except Exception:  # noqa: BLE001 - a factory that needs real tensors: built as workers do
        pass
    finally:
        torch.set_rng_state(rng)
    return built_model(cfg), False


def _plan_sample(dataset: Any, meta: bool) -> Any:
    """Inputs of the dataset's first two samples, as workers read them (on meta for a meta
    model); None where they cannot be read."""
    import torch

    from .data import fetch_batch

    try:
        n = min(2, len(dataset))
        x, _ = (dataset.head(n) if getattr(dataset, "by_columns", False)
                else fetch_batch(dataset, torch.arange(n)))
        return x.to("meta") if meta and isinstance(x, torch.Tensor) else x
    except Exception:  # noqa: BLE001 - preflight says what is wrong with the data
        return None


def _cmd_sweep(a: argparse.Namespace) -> int:
    from .sweep import cli

    return cli(a.sweep, n_trials=a.n_trials, scheduler=a.scheduler)


def _cmd_report(a: argparse.Namespace) -> int:
    from .report import write_report

    files = write_report(a.run_dir, a.out, x_axis=a.x)
    print(f"[elastic] report: {files.png}\n[elastic] report: {files.html}")
    return 0


def _options_of(a: argparse.Namespace) -> dict[str, Any]:
    """``--options`` (JSON) with ``--endpoint``: the storage options of ``elastic
    checkpoints``, for its URI and for an export's destination."""
    import json

    try:
        opts = json.loads(a.options) if a.options else {}
    except ValueError as e:
        raise SystemExit(f"elastic: --options is not JSON ({e.__class__.__name__} at "
                         f"{getattr(e, 'pos', '?')}). Fix: e.g. --options "
                         "'{\"region\": \"us-east-1\"}'") from None
    if not isinstance(opts, dict):
        raise SystemExit("elastic: --options must be a JSON object ({\"name\": value, ...}), "
                         f"got a {type(opts).__name__}")
    if a.endpoint:
        opts["endpoint_override"] = a.endpoint
    return opts


def _remote(uri: str | None) -> bool:
    return bool(uri) and "://" in str(uri) and not str(uri).startswith("file://")


def _store_of(a: argparse.Namespace) -> Any:
    """The checkpoints' store: with the storage options, unless they can only be the export
    destination's (a local checkpoint exported to S3)."""
    from .checkpoint import CheckpointStore

    for_out = a.action == "export" and _remote(a.out) and not _remote(a.uri)
    return CheckpointStore(a.uri, None if for_out else _options_of(a))


def _which(w: str) -> Any:
    return int(w) if w.isdigit() else w


def _check_out(dest: str | None) -> None:
    """``export --out``: given, and for a local file not a directory nor a ``file://`` URI
    with a host (``ConfigError`` naming ``--out``; was: a ValueError's traceback)."""
    from .checkpoint.location import local_path
    from .errors import ConfigError

    if not dest:
        raise SystemExit("elastic checkpoints export needs --out FILE")
    if _remote(dest):
        return
    try:
        out = local_path(dest)
    except ValueError as e:  # file://model.pt names the host "model.pt"
        raise ConfigError("--out", *e.args) from None
    from .checkpoint.tools import check_local_dest

    try:
        check_local_dest(dest, os.path.abspath(out))
    except ConfigError as e:
        raise ConfigError("--out", e.problem, e.fix) from None


def _cmd_checkpoints(a: argparse.Namespace) -> int:
    import json

    from .checkpoint import (
        export,
        format_inspect,
        format_list,
        inspect,
        list_checkpoints,
        nothing_found,
        verify,
    )

    if a.action == "export":
        _check_out(a.out)
    store = _store_of(a)
    if a.action == "list":
        rows = list_checkpoints(store)
        print(format_list(rows, None if rows else nothing_found(store)))
        # a directory with no checkpoint yet lists none; a path that is none fails (a script's
        # misspelled path, as `ls`: was 0)
        return 0 if rows or store.fs.get_file_info(store.root).type.name == "Directory" else 1
    if a.action == "inspect":
        info = inspect(store, _which(a.which or "latest"))
        print(json.dumps(info, indent=2, default=str) if a.json else format_inspect(info))
        return 0
    if a.action == "verify":
        report = verify(store, _which(a.which or "all"))
        if report.nothing:  # a CI gate on a misspelled path must not pass
            print(f"elastic: {report.nothing}", file=sys.stderr)
        for step in report.steps:
            probs = report.problems.get(step, [])
            print(f"step {step}: " + ("OK" if not probs else "BAD: " + "; ".join(probs)))
        return report.exit_code
    res = export(store, a.out, _which(a.which or "latest"), include_optimizer=a.optimizer,
                 dest_options=_options_of(a) if _remote(a.out) else None, overwrite=a.force)
    how = ("safetensors.torch.load_file(path)" if res.format == "safetensors"
           else "torch.load(path, weights_only=True)")
    print(f"wrote step {res.step} to {res.path} (load it with {how})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastic", description="Elastic training on Ray.")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run a job file (also under `ray job submit ... -- elastic run`)")
    r.add_argument("job", help="job YAML file")
    r.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a job setting")
    r.add_argument("--view", choices=["auto", "rich", "plain", "none"])
    r.set_defaults(fn=_cmd_run)

    d = sub.add_parser("demo", help="train the built-in GPT demo on a local Ray cluster")
    d.add_argument("--steps", type=int)
    d.add_argument("--workers", type=int)
    d.add_argument("--strategy")
    d.add_argument("--run-dir")
    d.add_argument("--view", choices=["auto", "rich", "plain", "none"])
    d.add_argument("--chaos", action="store_true",
                   help="on 3 local nodes: a preemption notice half-way (the node is "
                        "evacuated), then a node lost without notice (restored from peers)")
    d.set_defaults(fn=_cmd_demo)

    ck = sub.add_parser("checkpoints", help="list, inspect, verify or export checkpoints")
    ck.add_argument("action", choices=["list", "inspect", "verify", "export"])
    ck.add_argument("uri", help="checkpoint root: a path, s3://bucket/prefix, gs://...")
    ck.add_argument("--which", help="a step or 'latest' (the default; verify: all checkpoints)")
    ck.add_argument("--out", help="export: the file to write: .pt (torch.save) or .safetensors")
    ck.add_argument("--optimizer", action="store_true", help="export: include optimizer state")
    ck.add_argument("--force", action="store_true", help="export: replace an existing --out")
    ck.add_argument("--endpoint", help="S3-compatible endpoint, e.g. http://127.0.0.1:9000")
    ck.add_argument("--options", help="store options as JSON (region, retries, ...)")
    ck.add_argument("--json", action="store_true", help="inspect: machine-readable output")
    ck.set_defaults(fn=_cmd_checkpoints)

    pl = sub.add_parser("plan", help="rank the plans for a cluster and a job's model")
    pl.add_argument("job", help="job YAML file (its model, optimizer and global batch)")
    pl.add_argument("--cluster", default="live",
                    help="cluster file, an example name (a100-t4, h100x8, ...) or 'live'")
    pl.add_argument("--global-batch", type=int)
    pl.add_argument("--address", help="Ray cluster address for --cluster live")
    pl.add_argument("--prices", metavar="KEY=USD,...|FILE",
                    help="US dollars per device-hour by pool, device type or market (spot, "
                         "on_demand), e.g. a100=4.10,t4=0.39, or a YAML file of them; "
                         "default: the cluster file's, else the catalog's")
    pl.set_defaults(fn=_cmd_plan)

    sw = sub.add_parser("sweep", help="run or resume an Optuna sweep; every trial is a job")
    sw.add_argument("sweep", help="sweep YAML file (see docs/sweeps.md)")
    sw.add_argument("--n-trials", type=int, help="finished trials to reach (overrides the file)")
    sw.add_argument("--scheduler", help="queue the trials in this running elastic scheduler "
                    "(`elastic scheduler start`), sharing its workers with its other jobs")
    sw.set_defaults(fn=_cmd_sweep)

    rp = sub.add_parser("report", help="plot a run directory: PNG and HTML with events marked")
    rp.add_argument("run_dir", help="the job's run directory (default ./runs/<job name>)")
    rp.add_argument("--out", help="where to write the report (default: the run directory)")
    rp.add_argument("--x", choices=["step", "time"], default="step", help="x axis")
    rp.set_defaults(fn=_cmd_report)

    st = sub.add_parser("status", help="status of a running job (or list running jobs)")
    st.add_argument("job", nargs="?")
    st.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or auto)")
    st.set_defaults(fn=_cmd_status)
    for kind, helptext, arg in (("switch", "switch a running job to another strategy", "strategy"),
                                ("scale", "change a running job's number of workers", "workers"),
                                ("stop", "stop a running job at the next step boundary", None)):
        c = sub.add_parser(kind, help=helptext)
        c.add_argument("job")
        if arg:
            c.add_argument("value", metavar=arg.upper(), type=int if arg == "workers" else str)
        c.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or auto)")
        c.set_defaults(fn=_cmd_request(kind))
    dr = sub.add_parser("drain", help="evacuate a node of a running job (maintenance): its "
                                      "state moves onto the other workers, no step lost")
    dr.add_argument("job")
    dr.add_argument("node", help="the node's id (a prefix will do)")
    dr.add_argument("--deadline", type=float, help="seconds until the node goes (Ray is told)")
    dr.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or auto)")
    dr.set_defaults(fn=_cmd_drain)
    from .sched_cli import add_parsers

    add_parsers(sub, _attach, _parse_sets)
    return p


def _see_current_folder() -> None:
    """Put the current folder first on ``sys.path`` as ``python -m elastic`` does: the
    ``elastic`` console script puts its own ``bin`` folder there instead, so a job file's
    ``mymodule:factory`` in the folder the command runs in would not import. Ray's workers
    get the driver's current folder on their path from Ray itself (same machine, or the same
    layout on every node; ``ray job submit --working-dir`` ships it otherwise)."""
    cwd = os.getcwd()
    if not any(p in ("", ".") or os.path.abspath(p) == cwd for p in sys.path):
        sys.path.insert(0, cwd)


def main(argv: list[str] | None = None) -> int:
    _see_current_folder()
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except InterruptedJobError as e:
        print(f"elastic: {e}", file=sys.stderr)
        return e.exit_code
    except ElasticError as e:
        print(f"elastic: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the planner's own errors (clusters/ knows no elastic)
        from clusters import ClustersError

        if not isinstance(e, ClustersError):
            raise
        print(f"elastic: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("elastic: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
