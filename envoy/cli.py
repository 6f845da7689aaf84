"""Print textgen's Envoy bootstrap as JSON, e.g. for a compose file: python -m textgen.envoy.cli."""

from __future__ import annotations

import argparse
import json

from .config import Upstream, render


def main(argv: list[str] | None = None) -> None:
    """Print the bootstrap for the replicas given as HOST:PORT."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="0.0.0.0:8080", help="HOST:PORT to serve HTTP on")
    parser.add_argument("--admin-port", type=int, default=9901)
    parser.add_argument("--descriptor", default=None, help="descriptor set (default: packaged)")
    parser.add_argument("--front", action="store_true", help="front proxy of several replicas")
    parser.add_argument("upstreams", nargs="+", help="gRPC replicas as HOST:PORT")
    args = parser.parse_args(argv)
    host, port = args.listen.rsplit(":", 1)
    upstreams = [Upstream(h, int(p)) for h, p in (u.rsplit(":", 1) for u in args.upstreams)]
    config = render(
        upstreams,
        listen_host=host,
        listen_port=int(port),
        admin_port=args.admin_port,
        descriptor=args.descriptor,
        front=args.front,
    )
    print(json.dumps(config, indent=1))


if __name__ == "__main__":
    main()
