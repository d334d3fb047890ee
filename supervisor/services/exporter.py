"""An opt-in Prometheus ``/metrics`` endpoint for one babysat run.

The control loop pushes values in (``update``, ``observe_step``, ``count_intervention``,
``observe_health``); each call only stores numbers under a lock, a microsecond or two, so it may
be called every step. The text exposition is built on the server's thread when Prometheus
scrapes, from a copy taken under the same lock.

The exporter uses its own ``CollectorRegistry``, never prometheus-client's global one: the
supervisor's metrics must not mix with whatever else the process registers, and two exporters
(tests, a future multi-run supervisor) must not collide. By default it listens on 127.0.0.1
only: the metrics name the run and its health, and nothing here authenticates a scraper.

The port is fixed (``DEFAULT_PORT``, 9478) so a static scrape config finds every run on a
machine; a second run on the same machine needs its own ``prometheus.port``. When the run ends,
the final state (``succeeded``, ``failed``...) stays scrapeable for ``prometheus.linger_s``
seconds, and with ``prometheus.textfile`` set it is also written for the node exporter's
textfile collector, where it outlives babysit. A state shorter than a scrape interval
(``intervening``, ``relaunching``) is never lost: ``babysit_state_transitions_total`` counts
every transition.

Metrics (gauges unless said otherwise; a value not yet known is absent, not 0)::

    babysit_run_info{name}                       1, names the run (when a name is given)
    babysit_run_state{state}                     1 for the current state, 0 for the others
    babysit_attempt                              current attempt number
    babysit_step                                 newest step reported
    babysit_loss                                 loss at that step (mean over ranks)
    babysit_steps_per_second
    babysit_tokens_per_second
    babysit_mfu                                  model FLOPs utilisation, 0..1 (when reported)
    babysit_grad_norm                            gradient norm at the newest step
    babysit_lr_scale_ratio                       LR multiplier babysit applies (1 = untouched)
    babysit_step_duration_seconds                newest step's time (slowest rank)
    babysit_last_step_timestamp_seconds          when the newest step was merged (Unix time)
    babysit_last_good_checkpoint_step            newest checkpoint that passed probation
    babysit_last_good_checkpoint_age_seconds     how long ago that checkpoint was saved
    babysit_exit_code                            the supervisor's exit code, once the run ended
    babysit_state_transitions_total{from_state,to_state}  counter: every state change
    babysit_rank_step_seconds{rank}              each rank's latest step time
    babysit_interventions_total{incident,action} counter
    babysit_dropped_reports_total                counter: reports the workers could not send
    babysit_host_memory_available_bytes          from health samples (observe_health)
    babysit_disk_free_bytes
    babysit_gpu_temperature_celsius{gpu}
    babysit_gpu_memory_used_bytes{gpu}
    babysit_goodput_ratio                        productive step time / wall time, 0..1, so far
    babysit_goodput_wall_seconds                 the wall time the ledger covers (this session)
    babysit_goodput_seconds{category}            the goodput ledger: seconds per category
                                                 (productive, startup, checkpoint, restore,
                                                 detection, lost, relaunch, backoff, down,
                                                 straggler, shutdown, other); they sum to the
                                                 wall time. Live: updated every tick
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from pydantic import Field

from babysit.policies.decide import State
from babysit.policies.section import Section

if TYPE_CHECKING:
    # prometheus-client is imported when an Exporter is built, not with this module: the config
    # schema imports ExporterConfig, and a run with the exporter off should not pay for it.
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from babysit.supervisor.services.health import HealthSample


DEFAULT_PORT = 9478
"""The default metrics port (fixed, so a static scrape config finds the run)."""


class ExporterConfig(Section):
    """The Prometheus metrics endpoint (off unless enabled)."""

    enabled: bool = False
    """Serve ``http://<host>:<port>/metrics`` while the run lasts."""
    host: str = "127.0.0.1"
    """Address to listen on. The default accepts only local scrapers; ``0.0.0.0`` exposes the
    run's metrics to anyone who can reach this machine (there is no authentication)."""
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    """TCP port. The default is fixed so a static Prometheus scrape config finds the run; give a
    second run on the same machine its own port. 0 picks a free one (babysit prints and journals
    the port it got, but a static scrape config cannot follow it)."""
    linger_s: float = Field(30.0, ge=0.0)
    """Seconds to keep serving the final state after the run ends, so a scrape sees how it
    ended; set it to at least your scrape interval. Ctrl-C (or SIGTERM) ends the wait at once."""
    textfile: str | None = None
    """Also write the metrics to this file (atomically, at every state change and at the end)
    for the node exporter's textfile collector (``--collector.textfile.directory``; the name
    must end in ``.prom``). The last state then outlives babysit."""


class ExporterError(Exception):
    """The endpoint could not start; the message says why and what to change."""


class Exporter:
    """Holds the run's current numbers and serves them to Prometheus.

    Calling rules: the control loop calls the update methods from its own thread (cheap, safe to
    call every step); ``start()`` once, ``stop()`` once at the end (idempotent). The constructor
    does no I/O. Updates work whether or not the server was started.
    """

    def __init__(self, config: ExporterConfig, run_name: str | None = None) -> None:
        self.config = config
        self.run_name = run_name
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}
        self._state: str | None = None
        self._rank_step_s: dict[int, float] = {}
        self._interventions: dict[tuple[str, str], int] = {}
        self._gpus: dict[int, tuple[float | None, float | None]] = {}
        self._transitions: dict[tuple[str, str], int] = {}
        self._checkpoint_created: float | None = None
        self._goodput: dict[str, float] = {}
        from prometheus_client import CollectorRegistry

        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Collector(self))
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- serving ------------------------------------------------------------------------------

    def start(self) -> int:
        """Listen on ``config.host:config.port`` (a daemon thread serves); return the port bound."""
        if self._server is not None:
            return self.port or 0
        try:
            server = _serve(self.config.host, self.config.port, self._registry)
        except OSError as exc:
            taken = " (another babysit run on this machine?)" \
                if self.config.port == DEFAULT_PORT else ""
            raise ExporterError(
                f"Cannot serve metrics on {self.config.host}:{self.config.port}{taken}: "
                f"{exc.strerror or exc}. Set prometheus.port in the run config to a free port "
                f"(and point your scrape config at it), or turn the endpoint off with "
                f"prometheus.enabled: false."
            ) from None
        # A short poll interval: stop() waits for the serving loop to notice, and the default
        # half second would be added to every supervisor exit.
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                  name="babysit-metrics", daemon=True)
        thread.start()
        self._server, self._thread = server, thread
        return self.port or 0

    @property
    def port(self) -> int | None:
        """The bound port while serving, else None."""
        return int(self._server.server_port) if self._server is not None else None

    def stop(self) -> None:
        """Stop serving and close the socket. Blocks until the server thread has finished."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    # -- updates (control loop thread, cheap) ---------------------------------------------------

    def update(self, *, state: str | None = None, attempt: int | None = None,
               steps_per_second: float | None = None, tokens_per_second: float | None = None,
               mfu: float | None = None, dropped_reports: int | None = None) -> None:
        """Set the values given; ``None`` leaves a value as it was.

        ``state``: a ``policies.decide.State`` value such as ``"running"``. A new ``attempt``
        forgets the per-rank step times (ranks of the last attempt are gone).
        ``dropped_reports``: the run's total so far (not an increment).
        """
        with self._lock:
            if state is not None:
                self._state = state
            if attempt is not None:
                if self._values.get("attempt") != attempt:
                    self._rank_step_s.clear()
                self._values["attempt"] = attempt
            if steps_per_second is not None:
                self._values["steps_per_second"] = steps_per_second
            if tokens_per_second is not None:
                self._values["tokens_per_second"] = tokens_per_second
            if mfu is not None:
                self._values["mfu"] = mfu
            if dropped_reports is not None:
                self._values["dropped_reports"] = dropped_reports

    def observe_step(self, step: int, loss: float | None = None,
                     rank_step_s: Mapping[int, float] | None = None, *,
                     grad_norm: float | None = None, step_s: float | None = None,
                     at: float | None = None) -> None:
        """A step was merged: its number, mean loss, and each rank's step time in seconds (ranks
        missing from ``rank_step_s`` keep their previous value); ``grad_norm``, the job's step
        time ``step_s`` and the wall-clock time ``at`` (Unix seconds) when known."""
        with self._lock:
            self._values["step"] = step
            for key, value in (("loss", loss), ("grad_norm", grad_norm), ("step_s", step_s),
                               ("last_step_at", at)):
                if value is not None:
                    self._values[key] = value
            if rank_step_s:
                self._rank_step_s.update(rank_step_s)

    def observe_transition(self, old: str, new: str) -> None:
        """The supervisor's state changed: count it, and show ``new`` at once (the per-tick
        ``update`` would miss a state that lasts less than a tick)."""
        with self._lock:
            key = (old, new)
            self._transitions[key] = self._transitions.get(key, 0) + 1
            self._state = new

    def observe_run(self, *, lr_scale: float | None = None, exit_code: int | None = None) -> None:
        """The LR multiplier of the attempt now running; the exit code once the run ended."""
        with self._lock:
            if lr_scale is not None:
                self._values["lr_scale"] = lr_scale
            if exit_code is not None:
                self._values["exit_code"] = exit_code

    def observe_good_checkpoint(self, step: int, created: float | None) -> None:
        """A checkpoint passed probation; ``created`` is when it was saved (Unix seconds)."""
        with self._lock:
            if step >= self._values.get("good_checkpoint_step", -1):
                self._values["good_checkpoint_step"] = step
                self._checkpoint_created = created

    def write_textfile(self) -> None:
        """Write the metrics to ``config.textfile`` (atomically), if it is set. Raises OSError."""
        if self.config.textfile:
            from prometheus_client import write_to_textfile

            write_to_textfile(self.config.textfile, self._registry)

    def observe_goodput(self, wall_s: float, seconds: Mapping[str, float]) -> None:
        """The goodput ledger so far (``services.goodput.Goodput``'s ``wall_s`` and
        ``seconds``, category -> seconds)."""
        with self._lock:
            self._values["goodput_wall_s"] = wall_s
            if wall_s > 0:
                self._values["goodput"] = seconds.get("productive", 0.0) / wall_s
            self._goodput = dict(seconds)

    def count_intervention(self, incident: str, action: str) -> None:
        """One remedy was taken (e.g. ``"loss_spike"``, ``"rollback"``)."""
        with self._lock:
            key = (incident, action)
            self._interventions[key] = self._interventions.get(key, 0) + 1

    def observe_health(self, sample: HealthSample) -> None:
        """The latest health sample (from ``babysit.supervisor.services.schedule.HealthReport``)."""
        with self._lock:
            self._values["host_memory_available"] = sample.host.memory_available_bytes
            if sample.disk is not None:
                self._values["disk_free"] = sample.disk.free_bytes
            self._gpus = {g.index: (g.temperature_c, g.memory_used_bytes)
                          for g in sample.gpus or ()}

    # -- scrape (server thread) -----------------------------------------------------------------

    def _families(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            values = dict(self._values)
            state = self._state
            ranks = sorted(self._rank_step_s.items())
            interventions = sorted(self._interventions.items())
            gpus = sorted(self._gpus.items())
            transitions = sorted(self._transitions.items())
            created = self._checkpoint_created
            ledger = dict(self._goodput)
        if self.run_name is not None:
            info = GaugeMetricFamily("babysit_run_info", "The babysat run.", labels=["name"])
            info.add_metric([self.run_name], 1)
            yield info
        states = [s.value for s in State]
        if state is not None and state not in states:
            states.append(state)
        run_state = GaugeMetricFamily(
            "babysit_run_state", "1 for the supervisor's current state, 0 for the others.",
            labels=["state"])
        for s in states:
            run_state.add_metric([s], 1.0 if s == state else 0.0)
        yield run_state
        for key, name, doc in _SCALARS:
            if key in values:
                yield GaugeMetricFamily(name, doc, value=values[key])
        if created is not None:
            yield GaugeMetricFamily(
                "babysit_last_good_checkpoint_age_seconds",
                "Seconds since the newest checkpoint that passed probation was saved.",
                value=max(0.0, time.time() - created))
        moved = CounterMetricFamily("babysit_state_transitions",
                                    "Supervisor state changes, by the states left and entered.",
                                    labels=["from_state", "to_state"])
        for (old, new), n in transitions:
            moved.add_metric([old, new], n)
        yield moved
        per_rank = GaugeMetricFamily("babysit_rank_step_seconds",
                                     "Each rank's latest step time, in seconds.", labels=["rank"])
        for rank, seconds in ranks:
            per_rank.add_metric([str(rank)], seconds)
        yield per_rank
        counted = CounterMetricFamily("babysit_interventions",
                                      "Remedies taken, by incident and action.",
                                      labels=["incident", "action"])
        for (incident, action), n in interventions:
            counted.add_metric([incident, action], n)
        yield counted
        yield CounterMetricFamily("babysit_dropped_reports",
                                  "Step reports the workers dropped because babysit was behind.",
                                  value=values.get("dropped_reports", 0))
        temp = GaugeMetricFamily("babysit_gpu_temperature_celsius", "GPU core temperature.",
                                 labels=["gpu"])
        used = GaugeMetricFamily("babysit_gpu_memory_used_bytes", "GPU memory in use.",
                                 labels=["gpu"])
        for index, (celsius, used_bytes) in gpus:
            if celsius is not None:
                temp.add_metric([str(index)], celsius)
            if used_bytes is not None:
                used.add_metric([str(index)], used_bytes)
        yield temp
        yield used
        if ledger:
            split = GaugeMetricFamily(
                "babysit_goodput_seconds",
                "The goodput ledger: wall-clock seconds by category (productive or a cause of "
                "badput); they sum to babysit_goodput_wall_seconds.", labels=["category"])
            for category, seconds in ledger.items():
                split.add_metric([category], seconds)
            yield split


_SCALARS = (
    ("attempt", "babysit_attempt", "Current attempt number (each relaunch is a new attempt)."),
    ("step", "babysit_step", "Newest optimizer step reported by the ranks."),
    ("loss", "babysit_loss", "Loss at the newest step, mean over ranks."),
    ("steps_per_second", "babysit_steps_per_second", "Recent optimizer steps per second."),
    ("tokens_per_second", "babysit_tokens_per_second", "Recent tokens per second, whole job."),
    ("mfu", "babysit_mfu", "Model FLOPs utilisation (0..1): achieved over peak FLOP/s."),
    ("grad_norm", "babysit_grad_norm", "Gradient norm at the newest step."),
    ("lr_scale", "babysit_lr_scale_ratio",
     "LR multiplier babysit applies to the schedule (1 = untouched; rollbacks lower it)."),
    ("step_s", "babysit_step_duration_seconds", "The newest step's time, slowest rank."),
    ("last_step_at", "babysit_last_step_timestamp_seconds",
     "When the newest step was merged, in Unix seconds."),
    ("good_checkpoint_step", "babysit_last_good_checkpoint_step",
     "Step of the newest checkpoint that passed probation (a rollback's likely target)."),
    ("goodput", "babysit_goodput_ratio",
     "Productive step time over wall time so far, 0..1 (this supervisor's session)."),
    ("goodput_wall_s", "babysit_goodput_wall_seconds",
     "Wall-clock seconds the goodput ledger covers (this supervisor's session)."),
    ("exit_code", "babysit_exit_code", "The supervisor's exit code, once the run has ended."),
    ("host_memory_available", "babysit_host_memory_available_bytes",
     "Host memory available to new allocations."),
    ("disk_free", "babysit_disk_free_bytes", "Free bytes on the checkpoint file system."),
)


class _Server(ThreadingMixIn, WSGIServer):
    # A thread per request, daemonic so a stuck scraper never holds the supervisor's exit.
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not news: keep them off the supervisor's console."""


def _serve(host: str, port: int, registry: CollectorRegistry) -> _Server:
    from prometheus_client import make_wsgi_app

    # prometheus-client's start_http_server does the same, but serves with a fixed 0.5 s poll.
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(_Server):
        address_family = family  # IPv6 hosts ("::1") need AF_INET6

    return make_server(str(address[0]), port, make_wsgi_app(registry), Server, _QuietHandler)


class _Collector:
    """prometheus-client's collector protocol, over the exporter's stored values."""

    def __init__(self, exporter: Exporter) -> None:
        self._exporter = exporter

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return self._exporter._families()
