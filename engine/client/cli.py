"""`hicache`: the daemon (`hicache serve`) and a client for every RPC.

Exit codes: 0 ok, 1 error, 2 usage, 3 server unreachable / unavailable, 4 RPC error,
5 authentication or permission denied, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_RPC, EXIT_AUTH = 0, 1, 2, 3, 4, 5


def _serve(ns: argparse.Namespace) -> int:
    import asyncio
    import logging

    # NOTE: before torch loads OpenMP. Its threads spin at barriers by default, and lose badly
    # when the daemon's other work (gRPC, HTTP, the detokenizer) takes a core while a forward
    # runs (2 cores, 16 streams: 77 -> 95 tok/s in one process, 34 -> 79 split). The user's
    # own OMP_WAIT_POLICY wins; the split daemon's children inherit it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from engine.server.app import Daemon
    from engine.server.settings import ensure_storage_dir, load

    try:
        settings, server_args = load(ns)
        ensure_storage_dir(server_args)
    except (ValueError, TypeError, OSError) as e:
        print(f"hicache serve: {e}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(Daemon(settings, server_args).serve_forever())


def _client(ns: argparse.Namespace) -> Any:
    from engine.client import HicacheClient

    return HicacheClient(
        ns.addr,
        token=ns.token,
        admin_token=ns.admin_token,
        tls=ns.tls,
        ca_cert=ns.ca_cert,
        timeout=ns.timeout,
        client_cert=ns.client_cert,
        client_key=ns.client_key,
    )


def _tls_usage_error(ns: argparse.Namespace) -> str | None:
    """What is wrong with the TLS files (flags or env), before any connection; None if nothing."""
    if bool(ns.client_cert) != bool(ns.client_key):
        return "--client-cert and --client-key go together (env HICACHE_CLIENT_CERT / _KEY)"
    files = {
        "--ca-cert": ns.ca_cert,
        "--client-cert": ns.client_cert,
        "--client-key": ns.client_key,
    }
    for flag, path in files.items():
        if not path:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            return f"{flag} {path}: cannot read: {e.strerror or e}"
    return None


def _prompt(ns: argparse.Namespace) -> Any:
    if getattr(ns, "ids", False):
        try:
            return [int(t) for t in ns.prompt.replace(",", " ").split()]
        except ValueError:
            raise SystemExit(f"hicache: --ids needs integers, got {ns.prompt!r}") from None
    return sys.stdin.read() if ns.prompt == "-" else ns.prompt


def _generate(ns: argparse.Namespace) -> int:
    from engine.client.cli_output import enum_short, print_json, to_dict
    from engine.server.pb import gen_pb2

    sampling = {
        k: getattr(ns, k)
        for k in ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
        if getattr(ns, k) is not None
    }
    with _client(ns) as c:
        stream = c.generate(
            _prompt(ns),
            chat=ns.chat,
            namespace=ns.namespace,
            stop=ns.stop or None,
            ignore_eos=ns.ignore_eos or None,
            **sampling,
        )
        for r in stream:
            if ns.json:
                print_json(r)
            elif r.HasField("chunk"):
                sys.stdout.write(r.chunk.text)
                sys.stdout.flush()
            else:
                u = r.complete.usage
                reason = enum_short(gen_pb2.FinishReason.Name(r.complete.finish_reason))
                sys.stdout.write("\n")
                print(
                    f"[{reason}; prompt {u.prompt_tokens}, completion {u.completion_tokens}, "
                    f"cached {u.cached_tokens} (l1 {u.cached_tokens_per_tier.l1}, l2 "
                    f"{u.cached_tokens_per_tier.l2}, l3 {u.cached_tokens_per_tier.l3})]",
                    file=sys.stderr,
                )
                if ns.verbose:
                    print_json(to_dict(r.complete), sys.stderr)
    return EXIT_OK


def _repeat(ns: argparse.Namespace, once: Callable[[], None]) -> int:
    count = 0
    while True:
        once()
        count += 1
        if not ns.interval or (ns.count and count >= ns.count):
            return EXIT_OK
        time.sleep(ns.interval)


def _stats(ns: argparse.Namespace) -> int:
    from engine.client.cli_output import print_json, stats_report

    tty = sys.stdout.isatty()
    with _client(ns) as c:

        def once() -> None:
            resp = c.cache_stats()
            if ns.json:
                print_json(resp)
                return
            if tty and ns.interval:
                sys.stdout.write("\x1b[2J\x1b[H")
            elif ns.interval:
                sys.stdout.write("\n")  # piped: reports one after another
            stats_report(resp)
            sys.stdout.flush()

        return _repeat(ns, once)


def _tree(ns: argparse.Namespace) -> int:
    from engine.client.cli_output import enum_short, print_json, table, to_dict
    from engine.server.pb import common_pb2

    with _client(ns) as c:
        nodes = []
        for n in c.iter_tree(preview_tokens=ns.preview):
            nodes.append(n)
            if ns.limit and len(nodes) >= ns.limit:
                break
    if ns.json:
        print_json([to_dict(n) for n in nodes])
        return EXIT_OK
    rows = [
        [
            n.node_id,
            "  " * (n.depth - 1) + repr(n.preview)[1:-1][:48],
            n.token_length,
            n.prefix_length,
            ",".join(enum_short(common_pb2.Tier.Name(t)) for t in n.residency),
            n.lock_ref,
            "yes" if n.pinned else "",
            n.hit_count,
        ]
        for n in nodes
    ]
    table(rows, ["id", "preview", "tokens", "prefix", "tiers", "locks", "pinned", "hits"])
    return EXIT_OK


def _match(ns: argparse.Namespace) -> int:
    from engine.client.cli_output import fields, print_json

    with _client(ns) as c:
        r = c.match_prefix(_prompt(ns), chat=ns.chat, namespace=ns.namespace)
    if ns.json:
        print_json(r)
    else:
        t = r.matched_per_tier
        fields(
            [
                ("prompt_tokens", r.prompt_tokens),
                ("matched_tokens", r.matched_tokens),
                ("l1", t.l1),
                ("l2", t.l2),
                ("l3", t.l3),
                ("page_size", r.page_size),
            ]
        )
    return EXIT_OK


def _prefetch(ns: argparse.Namespace) -> int:
    from engine.client.cli_output import enum_short, print_json
    from engine.server.pb import admin_pb2

    with _client(ns) as c:
        for r in c.prefetch(
            _prompt(ns), chat=ns.chat, namespace=ns.namespace, pin=ns.pin, pin_ttl_s=ns.ttl
        ):
            if ns.json:
                print_json(r)
                continue
            t = r.cached_per_tier
            extra = (
                f" computed={r.computed_tokens}" if r.stage == admin_pb2.PREFETCH_STAGE_DONE else ""
            )
            extra += f" pin_id={r.pin_id}" if r.pin_id else ""
            print(
                f"{enum_short(admin_pb2.PrefetchStage.Name(r.stage))}: prompt={r.prompt_tokens}"
                f" l1={t.l1} l2={t.l2} l3={t.l3}{extra} ({r.elapsed_s:.2f}s)"
            )
    return EXIT_OK


def _unary(ns: argparse.Namespace, call: Callable[[Any], Any]) -> int:
    from engine.client.cli_output import print_json, to_dict

    with _client(ns) as c:
        r = call(c)
    if ns.json:
        print_json(r)
    else:
        for k, v in to_dict(r).items():
            print(f"{k}:{','.join(map(str, v)) if isinstance(v, list) else v}")
    return EXIT_OK


def _info(ns: argparse.Namespace) -> int:
    import json

    from engine.client.cli_output import print_json, server_info_report
    from engine.server.settings import describe_tiers

    with _client(ns) as c:
        info = c.server_info()
    if ns.json:
        print_json(info)
        return EXIT_OK
    tiers = None
    if "enable_hierarchical_cache" in info.config:  # the engine options are known
        tiers = describe_tiers({k: json.loads(v) for k, v in info.config.items()})
    server_info_report(info, tiers)
    return EXIT_OK


def _events(ns: argparse.Namespace) -> int:
    import datetime

    from engine.client.cli_output import enum_short, print_json
    from engine.server.pb import admin_pb2, common_pb2

    n = 0
    with _client(ns) as c:
        for r in c.watch_events(ns.after, ns.kind or None, ns.tier or None):
            e = r.event
            if ns.json:
                print_json(r)
            else:
                if r.missed:
                    print(f"... {r.missed} events missed")
                ts = datetime.datetime.fromtimestamp(e.time).strftime("%H:%M:%S.%f")[:-3]
                print(
                    f"{e.seq:>8} {ts} {enum_short(admin_pb2.CacheEventKind.Name(e.kind)):<9}"
                    f"{enum_short(common_pb2.Tier.Name(e.tier))} tokens={e.num_tokens} "
                    f"node={e.node_id}{' ns=' + e.cache_namespace if e.cache_namespace else ''}",
                    flush=True,
                )
            n += 1
            if ns.count and n >= ns.count:
                break
    return EXIT_OK


def _storage_call(c: Any, ns: argparse.Namespace) -> Any:
    if ns.action == "attach":
        if ns.backend is None:
            raise SystemExit("hicache storage attach: --backend file|redis is required")
        return c.attach_storage(ns.backend, ns.url, ns.dir)
    if ns.action == "detach":
        return c.detach_storage(ns.wait)
    return c.storage()


def _evict_args(ns: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {"namespace": ns.namespace, "dry_run": ns.dry_run}
    if ns.tokens is not None:
        kw["num_tokens"] = ns.tokens
    elif ns.prefix is not None:
        kw["prefix"], kw["chat"] = ns.prefix, ns.chat
    else:
        kw["all"] = True
    return kw


def build_parser(serve_options: bool = True) -> argparse.ArgumentParser:
    """`serve_options=False` leaves out `serve`'s options: their definitions import the engine's
    settings and with them torch, seconds of CPU that a client command does not need (the
    daemon image's healthcheck runs `hicache health` every 15-30 s)."""
    from engine.client.cli_args import add_client_commands

    p = argparse.ArgumentParser(prog="hicache", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the gRPC daemon")
    if serve_options:
        from engine.server.settings import add_arguments

        add_arguments(serve)
    serve.set_defaults(func=_serve)
    add_client_commands(
        sub,
        {
            "generate": _generate,
            "stats": _stats,
            "tree": _tree,
            "match": _match,
            "prefetch": _prefetch,
            "events": _events,
            "evict": lambda ns: _unary(ns, lambda c: c.evict(ns.tier, **_evict_args(ns))),
            "pin": lambda ns: _unary(
                ns, lambda c: c.pin(_prompt(ns), ns.ttl, ns.chat, ns.namespace)
            ),
            "unpin": lambda ns: _unary(ns, lambda c: c.unpin(None if ns.all else ns.pin_id)),
            "flush": lambda ns: _unary(ns, lambda c: c.flush(ns.tier or None, ns.wait)),
            "storage": lambda ns: _unary(ns, lambda c: _storage_call(c, ns)),
            "info": _info,
            "model": lambda ns: _unary(ns, lambda c: c.model_info()),
            "health": _health,
        },
    )
    return p


def _health(ns: argparse.Namespace) -> int:
    with _client(ns) as c:
        status = c.health(ns.service)
    print(status)
    return EXIT_OK if status == "SERVING" else EXIT_UNREACHABLE


_GLOBAL_VALUE_FLAGS = (
    "--addr",
    "--token",
    "--admin-token",
    "--ca-cert",
    "--client-cert",
    "--client-key",
)


def _hoist_global_flags(argv: list[str]) -> list[str]:
    """`hicache --addr H:P stats` == `hicache stats --addr H:P` (grpcurl/redis-cli habit)."""
    lead: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        flag = argv[i].split("=", 1)[0]
        if flag in _GLOBAL_VALUE_FLAGS and "=" not in argv[i] and i + 1 < len(argv):
            lead += argv[i : i + 2]
            i += 2
        elif flag in _GLOBAL_VALUE_FLAGS or flag == "--tls":
            lead.append(argv[i])
            i += 1
        else:
            break
    if not lead or i >= len(argv):
        return argv
    return [argv[i], *lead, *argv[i + 1 :]]


def main(argv: list[str] | None = None) -> int:
    argv = _hoist_global_flags(list(sys.argv[1:] if argv is None else argv))
    client = bool(argv) and not argv[0].startswith("-") and argv[0] != "serve"
    ns = build_parser(serve_options=not client).parse_args(argv)
    if ns.command != "serve":
        ns.addr = ns.addr or os.environ.get("HICACHE_ADDR", "127.0.0.1:50051")
        ns.token = ns.token or os.environ.get("HICACHE_TOKEN")
        ns.admin_token = ns.admin_token or os.environ.get("HICACHE_ADMIN_TOKEN")
        ns.ca_cert = ns.ca_cert or os.environ.get("HICACHE_CA_CERT")
        ns.client_cert = ns.client_cert or os.environ.get("HICACHE_CLIENT_CERT")
        ns.client_key = ns.client_key or os.environ.get("HICACHE_CLIENT_KEY")
        problem = _tls_usage_error(ns)
        if problem:
            print(f"hicache {ns.command}: error: {problem}", file=sys.stderr)
            return EXIT_USAGE
    try:
        return ns.func(ns)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - grpc.RpcError and others -> message + exit code
        return _report(e)


def _report(e: Exception) -> int:
    import grpc

    if not isinstance(e, grpc.RpcError) or not hasattr(e, "code"):
        print(f"hicache: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_ERROR
    code = e.code()
    print(f"hicache: {code.name}: {e.details()}", file=sys.stderr)
    if code == grpc.StatusCode.UNAVAILABLE:
        return EXIT_UNREACHABLE
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return EXIT_AUTH
    return EXIT_RPC


if __name__ == "__main__":
    sys.exit(main())
