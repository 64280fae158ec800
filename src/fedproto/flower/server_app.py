"""The Flower ``ServerApp``: the in-process round engine with its client step sent over Flower.

:class:`FlowerEngine` is :class:`fedproto.simulation.Simulation` with two methods replaced: the
client step (``train`` messages to the clients' SuperNodes) and the evaluation (``evaluate``
messages). Rounds, aggregation, monitoring, communication counting (from the algorithm
messages, as in the simulation), metrics and the run directory are the simulation's own code,
so the same config and seed give the numbers of ``execution=sequential``.

Run options come from the Flower run config (``[tool.flwr.app.config]`` of the Flower app, or
``flwr run --run-config``): every :class:`fedproto.config.RunConfig` option, ``-`` or ``_``.
The run directory is written where the ServerApp runs (``out_dir``, default ``runs/``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedproto.algorithms.base import Message as FedMessage
from fedproto.config import RunConfig
from fedproto.errors import ConfigError, FedprotoError, TrainingError
from fedproto.flower.common import CONFIG, MESSAGE, METRICS, QUERY, from_record, run_config, to_record
from fedproto.simulation import Simulation
from fedproto.training import TrainResult

log = logging.getLogger(__name__)

app = ServerApp()


class FlowerEngine(Simulation):
    """Run a configured experiment with one Flower SuperNode per client.

    Args:
        cfg: the run configuration (``checkpoint_every`` must be 0: client models stay on the
            nodes, so the server cannot checkpoint them).
        grid: the Flower :class:`~flwr.serverapp.Grid` of the run.
        out: run directory (as :class:`~fedproto.simulation.Simulation`).
        wait_s: seconds to wait for ``cfg.clients`` SuperNodes to connect (60 by default; a
            warning says it is waiting).
        timeout_s: seconds to wait for the replies of one round (None: no limit).
    Raises:
        ConfigError: checkpoints requested; nodes whose ``partition-id`` values do not cover
            ``0..clients-1`` exactly once.
        TrainingError: too few nodes connected, a node did not reply or replied with an error.
    """

    def __init__(self, cfg: RunConfig, grid: Grid, out=None, wait_s: float = 60.0,
                 timeout_s: float | None = None, on_round: Callable[[dict], None] | None = None):
        if cfg.checkpoint_every:
            raise ConfigError(f"checkpoint_every={cfg.checkpoint_every}: under Flower the client models stay on "
                              "the SuperNodes, so the server cannot checkpoint them; set checkpoint_every=0")
        super().__init__(cfg, out=out, on_round=on_round)
        self.grid = grid
        self.timeout_s = timeout_s
        self.round = 0
        self.nodes: dict[int, int] = {}  # client id -> node id, filled by _discover
        try:
            self.nodes = self._discover(wait_s)
        except BaseException:
            if self.run_dir:
                self.run_dir.discard_if_unused()  # no empty run folder left behind
            raise

    def _exchange(self, messages: list[Message], what: str) -> dict[int, Message]:
        """Send, wait for every reply; replies keyed by the sender's node id."""
        replies = list(self.grid.send_and_receive(messages, timeout=self.timeout_s))
        by_node = {rep.metadata.src_node_id: rep for rep in replies}
        cid_of = {v: k for k, v in self.nodes.items()}
        for m in messages:
            nid = m.metadata.dst_node_id
            who = f"client {cid_of[nid]} (node {nid})" if nid in cid_of else f"node {nid}"
            if nid not in by_node:
                within = f" within {self.timeout_s:g} s" if self.timeout_s else ""
                raise TrainingError(f"{what}: no reply from {who}{within}: the SuperNode went offline or its "
                                    "ClientApp died (see that node's log); restart it and run again")
            if by_node[nid].has_error():
                err = by_node[nid].error
                raise TrainingError(f"{what}: {who} failed (code {err.code}): {err.reason}")
        return by_node

    def _discover(self, wait_s: float) -> dict[int, int]:
        n = len(self.setup.states)
        deadline = time.monotonic() + wait_s
        ids = list(self.grid.get_node_ids())
        if len(ids) < n and wait_s > 0:
            log.warning("waiting up to %g s for %d SuperNodes (%d connected)", wait_s, n, len(ids))
        while len(ids) < n and time.monotonic() < deadline:
            time.sleep(1.0)
            ids = list(self.grid.get_node_ids())
        if len(ids) < n:
            raise TrainingError(f"{len(ids)} SuperNodes connected within {wait_s:g} s, but the run has clients={n}: "
                                "start one SuperNode per client (node config partition-id=0..clients-1)")
        replies = self._exchange([Message(RecordDict({}), dst_node_id=nid, message_type=QUERY) for nid in ids],
                                 "asking the nodes for their partition-id")
        nodes: dict[int, list[int]] = {}
        for nid, rep in replies.items():
            nodes.setdefault(int(rep.content[CONFIG]["cid"]), []).append(nid)
        dups = {c: v for c, v in nodes.items() if len(v) > 1}
        if dups:
            c, v = next(iter(dups.items()))
            raise ConfigError(f"nodes {v} all have partition-id={c}; give each SuperNode its own partition-id")
        missing = [c for c in range(n) if c not in nodes]
        if missing:
            raise ConfigError(f"no SuperNode has partition-id {missing[:10]} (the run has clients={n}); start one "
                              "SuperNode per client")
        return {c: v[0] for c, v in sorted(nodes.items())}

    def _send(self, kind: str, ids: Iterable[int], msgs: dict[int, FedMessage]) -> dict[int, Message]:
        out = [Message(RecordDict({MESSAGE: to_record(msgs[i]),
                                   CONFIG: ConfigRecord({"round": self.round, "cid": i})}),
                       dst_node_id=self.nodes[i], message_type=kind, group_id=str(self.round))
               for i in ids]
        by_node = self._exchange(out, f"round {self.round} ({kind})")
        return {i: by_node[self.nodes[i]] for i in ids}

    def _client_step(self, round: int, ids: list[int], msgs: dict[int, FedMessage]) -> dict:
        self.round = round
        replies = self._send(MessageType.TRAIN, ids, msgs)
        out = {}
        for i, rep in replies.items():
            m = rep.content[METRICS]
            out[i] = (from_record(rep.content[MESSAGE]),
                      TrainResult(None, None, float(m["loss_ce"]), float(m["loss_proto"]), int(m["steps"]),
                                  float(m.get("emb-norm-max", 0.0))))
        return out

    def evaluate(self) -> list[dict]:
        """Per-client metrics, computed on the nodes (list indexed by client id)."""
        alg = self.setup.algorithm
        ids = list(range(len(self.setup.states)))
        replies = self._send(MessageType.EVALUATE, ids, {i: alg.downlink(self.message, i) for i in ids})
        return [{k: float(v) for k, v in replies[i].content[METRICS].items() if k != "num-examples"} for i in ids]

    def run(self, resume: bool = False) -> dict:
        """Run all rounds (see :meth:`Simulation.run`); ``resume`` is not supported."""
        if resume:
            raise ConfigError("resume is not supported under Flower (client models stay on the nodes)")
        return super().run()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """ServerApp entry point: run the configured experiment and log its summary."""
    try:
        cfg = run_config(context.run_config)
        summary = FlowerEngine(cfg, grid).run()
    except FedprotoError as e:  # a user mistake: one line, no traceback (flwr run still exits 0)
        from fedproto.options import flower_wording

        log.error("fedproto: %s", e.render(flower_wording))  # options named as run-config keys
        return
    acc = summary["accuracy"].get("acc", {})
    log.warning("fedproto: %s on %s: accuracy %.2f ± %.2f %% over %d clients, %.1fk parameters up per round",
                cfg.algorithm, cfg.dataset, 100 * acc.get("mean", float("nan")), 100 * acc.get("std", float("nan")),
                summary["clients"], summary["params_per_round"]["up"] / 1e3)
