"""A node's requests to the scheduler survive a scheduler restart: real ZeroMQ
sockets inside the test process, a coordinator served from a thread, killed
(its socket closed) after a node's REPORT reached it unanswered, and
started again at the same address, restored from its state file or, restarted
before the file held the node (start-up), without it. The report is re-sent,
answered and counted once; a request re-sent to a live scheduler is answered
with its first reply, never handled twice."""

from __future__ import annotations

import contextlib
import threading

from hetps.proto.codec import Envelope
from hetps.proto.messages import Register, Report
from hetps.proto.transport import make_server
from hetps.runconfig.load import load_config
from hetps.runtime.membership import Membership
from hetps.scheduler import state
from hetps.scheduler.coordinator import Coordinator

WAIT_S = 30.0


class Served:
    """A coordinator on a real socket, served by a thread until `kill`."""

    def __init__(self, address: str, cfg, run_dir, restore: bool):
        self.server = make_server(address)
        self.coord = Coordinator(self.server, cfg, run_dir=run_dir)
        saved = state.read(run_dir) if restore else None
        if saved is not None:
            self.coord.restore(saved)
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.running:
            self.coord.serve_once(0.02)
            self.coord.tick()

    def freeze(self) -> None:
        """Nothing more is read or answered; what arrives waits in its socket."""
        self.running = False
        self.thread.join(timeout=WAIT_S)
        assert not self.thread.is_alive()

    def kill(self) -> None:
        """Gone without a word: what it received and did not answer is lost with it."""
        self.freeze()
        self.server.close()


def report_in_flight(member: Membership) -> tuple[threading.Thread, list]:
    """The evaluator's REPORT, sent from a thread; its outcome lands in the list."""
    outcome: list = []

    def send() -> None:
        try:
            member.report("eval", {"metrics": {"accuracy": 0.5}, "watch": "accuracy"})
            outcome.append("answered")
        except Exception as exc:  # the test says which
            outcome.append(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, outcome


def evaluator(address: str, cfg) -> Membership:
    member = Membership(address, "evaluator", 0, cfg.cluster)
    member.join()
    return member


@contextlib.contextmanager
def scheduler_and_evaluator(tmp_path, restore: bool):
    cfg = load_config(None, ["cluster.retry_s=0.2", "cluster.request_timeout_s=20"])
    address = f"ipc://{tmp_path}/scheduler"
    first = Served(address, cfg, tmp_path, restore)
    member = evaluator(address, cfg)
    again = None
    try:
        if restore:
            first.coord.save_state()  # the state file holds the evaluator
        first.freeze()
        thread, outcome = report_in_flight(member)
        thread.join(timeout=0.5)  # received by the frozen scheduler, never answered
        assert outcome == []
        first.kill()
        again = Served(address, cfg, tmp_path, restore)
        thread.join(timeout=WAIT_S)
        yield again.coord, outcome, member
    finally:
        member.close()
        for served in (first, again):
            if served is not None and served.running:
                served.kill()


def test_a_report_in_flight_reaches_a_scheduler_restarted_from_its_state(tmp_path):
    with scheduler_and_evaluator(tmp_path, restore=True) as (coord, outcome, member):
        assert outcome == ["answered"]
        assert coord.evals.count == 1 and coord.evals.final_metrics == {"accuracy": 0.5}
        assert member.node_id in coord.nodes


def test_a_report_in_flight_reaches_a_scheduler_restarted_during_start_up(tmp_path):
    # restarted before its state file held the evaluator: it answers BAD_STATE, the
    # evaluator registers again and the report goes once more
    with scheduler_and_evaluator(tmp_path, restore=False) as (coord, outcome, member):
        assert outcome == ["answered"]
        assert coord.evals.count == 1
        assert coord.nodes[member.node_id].role == "evaluator"


def test_a_re_sent_request_is_answered_with_its_first_reply(tmp_path):
    cfg = load_config(None, [])
    server = make_server(f"mem://answered-{tmp_path.name}")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path)
        register = coord.handlers[Register.OP]
        welcome = register(b"p", Envelope(Register(role="evaluator", rank=0), req_id=7, src=0))
        node = welcome.node_id
        # the same REGISTER again (its WELCOME was lost): the same node, not a second one
        assert register(b"q", Envelope(Register(role="evaluator", rank=0), req_id=7, src=0)) is (
            welcome
        )
        assert len(coord.nodes) == 1
        report = Report(node_id=node, kind="eval", values={"metrics": {"accuracy": 0.5}})
        first = coord.handlers[Report.OP](b"p", Envelope(report, req_id=8, src=node))
        again = coord.handlers[Report.OP](b"q", Envelope(report, req_id=8, src=node))
        assert again is first and coord.evals.count == 1 and coord.answered.retried == 2
        # a new request id is a new report
        coord.handlers[Report.OP](b"p", Envelope(report, req_id=9, src=node))
        assert coord.evals.count == 2
    finally:
        server.close()
