"""The orchestrator's flags that `specd serve orchestrator` and `specd up` share: admission limits, the
fault policy, drafting ahead, and routing over replicas."""

from specd.orchestrator.faults import FaultPolicy


def add_orchestrator_limit_flags(parser) -> None:
    policy = FaultPolicy()
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests in flight at once; more are refused RESOURCE_EXHAUSTED (default: no limit)",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        metavar="N",
        help="longest prompt accepted (default: what a session holds)",
    )
    parser.add_argument(
        "--propose-timeout",
        type=float,
        default=policy.propose_timeout_s,
        metavar="S",
        help="cap on one draft call; a slower draft is skipped for that step (target-only)",
    )
    parser.add_argument(
        "--call-timeout",
        type=float,
        default=policy.call_timeout_s,
        metavar="S",
        help="cap on one target call (the client's deadline may be shorter)",
    )
    parser.add_argument(
        "--target-retry",
        type=float,
        default=policy.target_retry_s,
        metavar="S",
        help="retry an unavailable target this long, then end the request UNAVAILABLE",
    )


def add_draft_ahead_flag(parser) -> None:
    """--draft-ahead: the orchestrator's default for requests that leave GenerateRequest.draft_ahead empty."""
    from specd.orchestrator.ahead import DEFAULT_DRAFT_AHEAD, DRAFT_AHEAD_MODES

    parser.add_argument(
        "--draft-ahead",
        choices=DRAFT_AHEAD_MODES,
        default=DEFAULT_DRAFT_AHEAD,
        help="while the target verifies a step, the draft already guesses the next one, used when the whole "
        f"step is accepted (default {DEFAULT_DRAFT_AHEAD}: where the measured costs say it pays; a draft and a "
        f"target both on the CPU at loopback addresses, as `specd up` runs them, are taken to share cores)",
    )


def add_routing_flag(parser) -> None:
    """--routing: how the orchestrator places new requests on a pool of replicas (router.py);
    --migration-limit: how often a request may move off a failed target replica (migration.py); and
    --step-deadline: how long a target replica may be silent before it counts as failed (faults.py)."""
    from specd.orchestrator.migration import MIGRATION_LIMIT
    from specd.orchestrator.router import ROUTINGS

    parser.add_argument(
        "--routing",
        choices=ROUTINGS,
        default=ROUTINGS[0],
        help="with several target or draft replicas, how each new request is placed: prefix (default: by the "
        "prefixes each replica was sent, inside a load bound) or round-robin (in turn, the baseline)",
    )
    parser.add_argument(
        "--migration-limit",
        type=int,
        default=MIGRATION_LIMIT,
        metavar="N",
        help=f"with several target replicas, a request whose replica fails moves to another and goes on exactly "
        f"where it was, up to N times (default {MIGRATION_LIMIT}; 0: it fails UNAVAILABLE)",
    )
    parser.add_argument(
        "--step-deadline",
        type=float,
        default=FaultPolicy.step_timeout_s,
        metavar="S",
        help=f"with several target replicas, a target that does not answer a step within S seconds (more for a "
        f"call that first catches up on many tokens) is given up as failed and its request moves to another "
        f"(default {FaultPolicy.step_timeout_s:g}; a frozen replica is left after this, not after --call-timeout)",
    )


def policy_from_args(args) -> FaultPolicy:
    """The fault policy the flags above ask for."""
    return FaultPolicy(
        propose_timeout_s=args.propose_timeout,
        call_timeout_s=args.call_timeout,
        target_retry_s=args.target_retry,
        step_timeout_s=args.step_deadline,
    )
