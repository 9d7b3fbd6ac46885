"""wandb: Weights & Biases plus the console view. The mode is ``logger.mode``, else $WANDB_MODE, else
offline. wandb is imported lazily (1-2.5 s), on rank 0 only."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from framework.core import files
from framework.core.errors import ConfigError, first_line, say
from framework.loggers._base import RunInfo
from framework.loggers.console import Console
from framework.core.registry import Component

RUN_ID = "wandb-run-id"   # in the run folder: the W&B run a resume from the folder's checkpoints continues, as
#                           JSON {"id", "step"}: the last step it logged, which a resume behind it must not repeat

# wandb's own modes (its Settings.mode); "shared" and "run" go online as "online" does, "dryrun" is offline.
MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")
ONLINE = ("online", "shared", "run")
INIT_TIMEOUT_S = 90.0   # W&B's own wait for its server to start a run (its init_timeout), where it names none
PEERS_SHARE = 0.5       # the part of dist.timeout_s W&B's whole start may take while the other ranks wait for it
MIN_INIT_S = 1.0        # the least wait W&B is given for its server, however long its setup took
# W&B's words (its Go service's, Python's) for a server it did not reach, rather than one that refused the run
UNREACHABLE = ("timed out", "dial tcp", "no such host", "connection refused", "network is unreachable",
               "name resolution", "name or service not known", "connection reset")


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    project: str = "framework"
    entity: str | None = None
    mode: str | None = None          # online | offline | disabled (or wandb's shared, dryrun, run); None: $WANDB_MODE or offline
    tags: list[str] = field(default_factory=list)
    live: bool | None = None         # console bar, as in logger=console


class WandbLogger:
    def __init__(self, cfg: WandbConfig, *, run: RunInfo):
        self.cfg, self.run_info = cfg, run
        self.console = Console(cfg.live)
        self.run = None
        self.finished = False   # finish(summary) reached
        self.row_open = False   # a step logged here whose W&B row is not committed yet
        self.run_id, self.logged = None, 0   # the W&B run kept in RUN_ID (None: none kept) and its last step
        self.kept = False   # RUN_ID written once by this process

    def start(self, config: dict, total_steps: int) -> None:
        t0 = time.monotonic()   # the other ranks' wait for this start begins about now
        import wandb

        run_id, logged = self._kept() if self.run_info.resumed else (None, None)
        if run_id is not None and logged is not None and self.run_info.start < logged:
            # A resume from an earlier checkpoint (a kill between two saves, or checkpoint.resume=<own step-N>)
            # logs the steps after it again: into that run, W&B online drops them (its steps only go up) and
            # offline keeps both copies. A new W&B run logs them; the old one keeps the history it had.
            behind, run_id = run_id, None
        else:
            behind, self.logged = None, logged or 0
        wait, bound, left = self.run_info.peers_wait_s, None, None
        try:
            # The mode process-wide too, not only for this run: W&B's own usage telemetry reads it there, and
            # would go online (to W&B's servers) from an offline run. (Each job sets it; a job after an online
            # one in the same process, as in a sweep mixing modes, may still send that telemetry.) With other
            # ranks waiting, no account look-up either: it only names the user in W&B's "logged in" line, and
            # its retries (~10 s without a network) come before init_timeout's clock starts, so no bound of
            # ours would hold.
            viewer = (dict(x_disable_viewer=wait is not None)
                      if "x_disable_viewer" in getattr(wandb.Settings, "model_fields", ()) else {})
            own = getattr(getattr(wandb.setup(settings=wandb.Settings(mode=mode(self.cfg), **viewer)), "settings",
                                  None), "init_timeout", INIT_TIMEOUT_S)
            # The other ranks wait for this start in a collective of dist.timeout_s: W&B gives up well before
            # (its own wait is ~2 min without a network), so they hear its error rather than time out. The
            # bound is for the whole start: what its import and setup took is taken off init's wait.
            spent = time.monotonic() - t0
            if wait is not None and wait * PEERS_SHARE < own + spent:
                bound = wait * PEERS_SHARE
                left = max(bound - spent, MIN_INIT_S)
            self.run = wandb.init(project=self.cfg.project, entity=self.cfg.entity, mode=mode(self.cfg),
                                  group=self.run_info.group, name=self.run_info.name, tags=list(self.cfg.tags),
                                  dir=str(self.run_info.run_dir), config=config, reinit="finish_previous",
                                  **(dict(settings=wandb.Settings(init_timeout=left)) if left else {}),
                                  **(dict(id=run_id, resume="allow") if run_id else {}))
        except Exception as e:   # (UsageError, CommError, pydantic's ValidationError, ...): one line, no traceback
            raise self._refused(e, bound) from None
        if mode(self.cfg) != "disabled" and self.run is not None:
            self.run_id = self.run.id
            if self.run.id != run_id:
                self._keep()   # for a resume of this run
            if behind is not None:
                print(f"W&B: this run goes on from step {self.run_info.start}, behind step {logged} that the W&B run "
                      f"{behind} logged: a new W&B run, {self.run.id}, logs it on ({behind} keeps the steps it "
                      f"logged)", flush=True)
        self.console.start(config, total_steps)

    def _refused(self, e: Exception, bound: float | None) -> ConfigError:
        """One line for W&B failing to start the run: its files, its server out of reach, else its settings."""
        if isinstance(e, OSError) and e.filename:   # its files: no setting or key of W&B's is at fault
            return ConfigError(f"logger=wandb: W&B cannot write its files in {self.run_info.run_dir / 'wandb'} "
                               f"({e.strerror or e}: {e.filename}); move away what is in the way there (a file "
                               f"where a folder belongs), fix its permissions or free space, or choose another "
                               f"run folder")
        # (W&B's advice to pass wandb.Settings(init_timeout=...) to wandb.init is none a user of this CLI can take)
        # (any whitespace before it: W&B's Go service puts a line break there)
        why = re.split(r"\s+(?:For further information|Consider increasing)", str(e))[0]
        why = " ".join(why.split())[:300] or type(e).__name__
        offline = ", or run with logger.mode=offline" if mode(self.cfg) in ONLINE else ""
        if isinstance(e, TimeoutError) or any(m in why.lower() for m in UNREACHABLE):
            within = (f" within {bound:g}s ({PEERS_SHARE:g} of dist.timeout_s, which the other ranks wait for it; "
                      f"raise dist.timeout_s to wait longer)" if bound else "")
            return ConfigError(f"logger=wandb: could not reach the W&B server{within}: {why}; check the network "
                               f"(and WANDB_BASE_URL if set){offline}")
        return ConfigError(f"logger=wandb: W&B refused to start the run: {why}; check the logger.* settings "
                           f"(project, entity, tags, mode) and WANDB_API_KEY{offline}")

    def _kept(self) -> tuple[str | None, int | None]:
        """The W&B run a resumed run continues, the one this run folder's earlier run wrote, and the last step it
        logged (None: not known)."""
        try:
            with os.fdopen(files.open_nofollow(self.run_info.run_dir / RUN_ID, os.O_RDONLY)) as f:
                text = f.read().strip()
        except (OSError, UnicodeDecodeError):   # none (or unreadable): a new W&B run
            return None, None
        try:
            kept = json.loads(text)
        except ValueError:
            kept = None
        if not isinstance(kept, dict):   # an id alone: its last step is not known, and that run goes on
            return text or None, None
        run_id, step = kept.get("id"), kept.get("step")
        return (run_id if isinstance(run_id, str) and run_id else None,
                step if isinstance(step, int) and not isinstance(step, bool) else None)

    def _keep(self, durable: bool = True) -> None:
        kept = {"id": self.run_id, "step": self.logged}
        # (the folder listed for dead writers' temporaries at the first write, not again in the training loop)
        files.write_atomic(self.run_info.run_dir / RUN_ID, json.dumps(kept).encode(), durable=durable,
                           sweep=not self.kept)
        self.kept = True

    def log(self, record: dict) -> None:
        self.console.log(record)
        self._call(lambda run: self._log(run, record))

    def _log(self, run, record: dict) -> None:
        run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        self.row_open = True
        if self.run_id is not None and record["step"] > self.logged:   # (an evaluation logs at its step again)
            self.logged = record["step"]
            # Rewritten at each new step, inside the training loop (every rank waits for rank 0 at the next
            # collective): no fsync, which would cost milliseconds a log. A crash may lose the newest record
            # (the file keeps an older step, or on some file systems is left empty): a resume then continues
            # the old W&B run rather than starting a new one (or starts a new one), which is harmless.
            self._keep(durable=False)

    def finish(self, summary: dict) -> None:
        self.console.finish(summary)
        self.finished = True
        # W&B keeps the last step's row open until run.finish commits it, and committing writes that row's values
        # into the summary over ours (its tokens_per_s, one log window's, over the run's): commit it first. (Only
        # an open one: with none, the commit would write an empty row.)
        if self.row_open:
            self._call(lambda run: run.log({}, commit=True))
        self._call(lambda run: run.summary.update({k: v for k, v in summary.items()
                                                   if isinstance(v, (int, float, str))}))

    def close(self) -> None:
        self.console.close()
        # A run that ended before its summary failed: W&B records it so (exit code 0 is "finished").
        self._call(lambda run: run.finish(exit_code=None if self.finished else 1))
        self.run = None

    def _call(self, act) -> None:
        """``act(self.run)``. W&B failing mid-run (its service process gone, say) ends its record, not the
        training: one note, and the run is dropped."""
        if self.run is None:
            return
        try:
            act(self.run)
        except Exception as e:
            self.run = None
            say(f"note: W&B stopped ({type(e).__name__}: {first_line(e)}); this run logs no more to W&B, "
                f"metrics.jsonl goes on")
            import wandb

            # Now, quietly, rather than at exit with a traceback; and a later run in this process (a sweep's
            # next job) starts a service of its own. (Its exit code for a service that died is a SystemExit.)
            with contextlib.suppress(Exception, SystemExit):
                wandb.teardown()


FORBIDDEN = "/\\#?%:"   # W&B refuses these in a project name (after the run is set up)
PROJECT_MAX, TAG_MAX = 128, 64   # W&B's limits on a project name and on each tag


def mode(cfg: WandbConfig) -> str:
    """``logger.mode``, else WANDB_MODE, else offline."""
    return cfg.mode or os.environ.get("WANDB_MODE") or "offline"


def key_configured() -> bool:
    """Whether W&B finds credentials here, as wandb.init would, without prompting or asking the server. A key
    W&B refuses by its form is a ConfigError."""
    from wandb.errors import Error

    try:   # wandb's own look-up: private, and only in recent versions (pyproject takes wandb>=0.19.9)
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        authenticate, host = wbauth.authenticate_session, wandb_setup.singleton().settings.base_url
    except (ImportError, AttributeError):
        return _key_in_environment_or_netrc()
    try:
        return authenticate(host=host, source="logger=wandb", prompt=False, update_session=False) is not None
    except Error as e:   # (AuthenticationError: a key of the wrong form)
        raise ConfigError(f"logger=wandb: {first_line(e)}; fix WANDB_API_KEY "
                          f"(or `wandb login`), or set logger.mode=offline") from None


def _key_in_environment_or_netrc() -> bool:
    """Where every wandb version looks: WANDB_API_KEY, an identity token file, or .netrc for the server's host."""

    import netrc
    from urllib.parse import urlsplit

    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    url = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    try:
        entries = netrc.netrc(os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc"))
    except (OSError, netrc.NetrcParseError):   # none, or unreadable: W&B would find no key there either
        return False
    return any((entries.authenticators(host) or (None, None, None))[2] for host in {url.netloc, url.hostname} if host)


def check(cfg: WandbConfig, stage: str, nodes: Mapping[str, Any]) -> WandbConfig:
    """When composing, before any run folder or rank: what W&B would refuse only once the run starts."""
    if cfg.mode is not None and cfg.mode not in MODES:
        raise ConfigError(f"logger.mode={cfg.mode!r} is not one of {', '.join(MODES)}")
    env = os.environ.get("WANDB_MODE")
    if cfg.mode is None and env and env not in MODES:
        raise ConfigError(f"the environment variable WANDB_MODE={env!r} is not one of {', '.join(MODES)}; "
                          "fix or unset it, or set logger.mode")
    if bad := sorted(set(FORBIDDEN) & set(cfg.project)):
        raise ConfigError(f"logger.project={cfg.project!r} has a character W&B refuses ({' '.join(bad)}); "
                          f"choose a name without any of {' '.join(FORBIDDEN)}")
    if len(cfg.project) > PROJECT_MAX:
        raise ConfigError(f"logger.project is {len(cfg.project)} characters long; W&B takes at most {PROJECT_MAX}")
    for tag in cfg.tags:
        if not 1 <= len(str(tag)) <= TAG_MAX:
            raise ConfigError(f"logger.tags: the tag {str(tag)[:TAG_MAX]!r}{'...' if len(str(tag)) > TAG_MAX else ''} "
                              f"is {len(str(tag))} characters long; W&B takes tags of 1 to {TAG_MAX} characters")
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("logger=wandb needs wandb, which is not installed: pip install wandb, or logger=console")
    if mode(cfg) in ONLINE and not key_configured():
        where = f"logger.mode={cfg.mode}" if cfg.mode else f"WANDB_MODE={mode(cfg)}"
        raise ConfigError(f"{where} logs to the W&B server, and no W&B API key is configured: set WANDB_API_KEY "
                          f"(or run `wandb login`), or set logger.mode=offline")
    return cfg


def notes(cfg: WandbConfig, config) -> list[str]:
    """Under W&B's own mode disabled nothing is sent nor written: a project, entity or tags of its own do nothing."""
    default = WandbConfig()
    stated = [f"logger.{key}" for key in ("project", "entity", "tags")
              if getattr(cfg, key) != getattr(default, key) and getattr(cfg, key)]
    where = f"logger.mode={cfg.mode}" if cfg.mode else "WANDB_MODE=disabled"
    verb, them = ("changes", "it") if len(stated) == 1 else ("change", "them")
    return [f"note: {' and '.join(stated)} {verb} nothing with {where} (W&B records nothing); drop {them}, or use "
            "logger.mode=offline to keep a W&B run in the run folder"] if stated and mode(cfg) == "disabled" else []


COMPONENT = Component(config=WandbConfig, build=WandbLogger, check=check, notes=notes)
