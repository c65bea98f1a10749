"""The `streamq` command: serve, api, worker, scheduler, prepare-model, bench."""
from __future__ import annotations

import argparse
import sys


def _log(level: str | None) -> None:
    from shared.logs import setup
    from shared.settings import CommonSettings

    settings = CommonSettings()
    setup(level or settings.log_level, settings.log_format)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    _log(args.log_level)
    _run(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamq", description="Serve a language model to many users at once.")
    parser.add_argument("--log-level", default=None, help="debug, info, warning, error (default: STREAMQ_LOG_LEVEL, info)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub.add_parser("serve", help="Redis (unless REDIS_URL is set), a worker and the api, supervised."))
    sub.add_parser("api", help="One api replica (settings from STREAMQ_* variables).")
    sub.add_parser("worker", help="One model worker (settings from STREAMQ_* variables).")
    sub.add_parser("scheduler", help="The scheduler: periodic jobs (arq).")
    sub.add_parser("prepare-model", help="Convert and cache the configured model, then exit.")
    _add_keys(sub.add_parser("keys", help="API keys: create, list, revoke (stored hashed in Redis)."))
    from streamq.bench import add_arguments  # light: httpx only
    add_arguments(sub.add_parser("bench", help="Load a running server and report latency and throughput."))
    return parser


def _add_serve(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-replicas", type=_positive, default=1,
                       help="api processes; above 1, nginx listens on --port in front of them (like compose's lb)")
    serve.add_argument("--workers", type=_positive, default=1, help="model worker processes sharing the request stream")


def _add_keys(keys_cmd: argparse.ArgumentParser) -> None:
    keys_sub = keys_cmd.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="Create a key for a tenant; the key is printed once.")
    create.add_argument("--tenant", required=True)
    create.add_argument("--name", default="", help="a label, e.g. who holds the key")
    keys_sub.add_parser("list", help="List the keys: tenant, label, creation time, hint (never the key).")
    revoke = keys_sub.add_parser("revoke", help="Revoke a key, given the key or the hint that `list` shows.")
    revoke.add_argument("key")
    limits = keys_sub.add_parser("limits", help="Set a tenant's limits (0 = none), shared by all its keys; "
                                                "those not given keep their values.")
    limits.add_argument("--tenant", required=True)
    limits.add_argument("--rpm", type=int, help="requests per minute")
    limits.add_argument("--tpm", type=int, help="tokens per minute (prompt + max_tokens)")
    limits.add_argument("--concurrent", type=int, help="unfinished requests at once")
    limits.add_argument("--weight", type=float,
                        help="share of the workers' batches relative to other tenants (fair scheduling; default 1)")
    limits.add_argument("--tiers", help="the service tiers the tenant may use, comma-separated, of priority, "
                                        "default, flex (default: default,flex)")
    limits.add_argument("--auto-tier", choices=["priority", "default", "flex"],
                        help="the tier a request asking for service_tier auto (or none) gets (default: default)")


def _run(args: argparse.Namespace) -> None:
    """The subcommand; its heavy imports only here, for the one that runs."""
    if args.command == "serve":
        from streamq.serve import serve as run_serve
        sys.exit(run_serve(args.host, args.port, args.api_replicas, args.workers))
    if args.command == "keys":
        sys.exit(_keys(args))
    if args.command == "bench":
        from streamq.bench import main as bench_main
        sys.exit(bench_main(args))
    if args.command == "api":
        from api.main import main as api_main
        api_main()
    elif args.command == "worker":
        from worker.model.openmp import restart_with_intel_openmp  # imports no torch
        restart_with_intel_openmp()
        from worker.main import main as worker_main
        worker_main()
    elif args.command == "scheduler":
        from scheduler.main import main as scheduler_main
        scheduler_main()
    elif args.command == "prepare-model":
        _prepare_model()


def _prepare_model() -> None:
    from shared.logs import route_transformers
    from shared.model_paths import prepare_model
    from shared.model_source import ModelNotFound
    from shared.settings import CommonSettings
    route_transformers()
    try:
        print(prepare_model(CommonSettings()))
    except ModelNotFound as exc:
        sys.exit(f"streamq prepare-model: {exc}")


def _keys(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from shared.api_keys import KeyStore
    from shared.redis_client import connect
    from shared.settings import CommonSettings

    async def run() -> int:
        settings = CommonSettings()
        redis = connect(settings.redis_url)
        store = KeyStore(redis, settings.prefix)
        try:
            if args.keys_command == "create":
                print(await store.create(args.tenant, args.name))
            elif args.keys_command == "limits":
                from api.core.limits import Limits

                from shared import service_tier

                try:
                    tiers = service_tier.parse(args.tiers) if args.tiers is not None else None
                    await Limits(redis, settings.prefix, 0).set(args.tenant, args.rpm, args.tpm, args.concurrent,
                                                                args.weight, tiers, args.auto_tier)
                except ValueError as exc:
                    print(exc, file=sys.stderr)
                    return 2
            elif args.keys_command == "list":
                for entry in await store.list():
                    created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(entry["created_at"]))
                    print(f"{entry['hint']}…  tenant={entry['tenant']}  name={entry['name']}  created={created}Z")
            elif not await store.revoke(args.key):
                print(f"no single key matches {args.key!r}", file=sys.stderr)
                return 1
            return 0
        finally:
            await redis.aclose()
    return asyncio.run(run())


if __name__ == "__main__":
    main()
