"""`specd scale`: list, add and remove an orchestrator's target and draft replicas while it serves
(specd.v1.Replicas, orchestrator/scaling.py).

    specd scale list
    specd scale add target 10.0.0.7:50062          # start `specd serve target` there first
    specd scale remove target 10.0.0.7:50062       # answers once it drained; then stop it
"""

import argparse
import asyncio
import sys

import grpc
from rich.console import Console
from rich.table import Table

from specd.cli.common import UserError
from specd.proto.auth import add_client_flags, client_security_from_args

DEFAULT_SERVER = "127.0.0.1:50051"


def add_parser(verbs) -> None:
    parser = verbs.add_parser(
        "scale",
        help="list, add or remove an orchestrator's target and draft replicas while it serves",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--server", default=DEFAULT_SERVER, metavar="HOST:PORT", help="the orchestrator")
    add_client_flags(parser, "--server")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", help="every replica and the requests on it")
    for action, text in (
        ("add", "route new requests to one more replica (checked first: it must serve the pool's model)"),
        ("remove", "route no new request to a replica; answers once the requests on it ended"),
    ):
        sub = actions.add_parser(action, help=text)
        sub.add_argument("role", choices=("target", "draft"))
        sub.add_argument("address", metavar="HOST:PORT", help="the replica, as the orchestrator dials it")
        if action == "remove":
            sub.add_argument(
                "--drain-seconds",
                type=float,
                default=60.0,
                help="how long to wait for the requests on it (default 60); past that it is listed as draining",
            )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        security = client_security_from_args(args)
    except ValueError as error:
        raise UserError(str(error)) from error
    try:
        replicas = asyncio.run(_call(args, security))
    except grpc.aio.AioRpcError as error:
        raise UserError(f"{args.action}: {error.code().name}: {error.details()}") from None
    table = Table("role", "replica", "requests", "state")
    for replica in replicas:
        table.add_row(
            replica.role, replica.address, str(replica.in_flight), "draining" if replica.draining else "serving"
        )
    Console().print(table)
    draining = [r.address for r in replicas if r.draining]
    if args.action == "remove" and args.address in draining:
        print(f"{args.address} still has requests after {args.drain_seconds:g} s: it is draining", file=sys.stderr)
        return 1
    return 0


async def _call(args: argparse.Namespace, security) -> list:
    from specd.proto.client import channel
    from specd.v1 import specdecode_pb2, specdecode_pb2_grpc

    async with channel(args.server, security) as open_channel:
        stub = specdecode_pb2_grpc.ReplicasStub(open_channel)
        if args.action == "list":
            reply = await stub.List(specdecode_pb2.ListReplicasRequest(), timeout=10)
        elif args.action == "add":
            reply = await stub.Add(specdecode_pb2.ReplicaRequest(role=args.role, address=args.address), timeout=30)
        else:
            request = specdecode_pb2.ReplicaRequest(
                role=args.role, address=args.address, drain_seconds=args.drain_seconds
            )
            reply = await stub.Remove(request, timeout=args.drain_seconds + 30)
        return list(reply.replicas)
