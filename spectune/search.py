"""The Optuna side of tuning: the search space of SGLang adaptive configs, the study (RDB storage, shared by
workers on several machines) and the ask/tell loop.

Scaling out: a study lives in an Optuna RDB storage (default sqlite:///<RESULTS_DIR>/study.db). On each node,
`spectune tune DIR --storage postgresql://... --worker --trials N` joins it and only runs trials; afterwards one
`spectune tune DIR --storage ... --trials 0` writes the configs from the best trial of the whole study.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spectune.adaptive import AdaptiveConfig, SlotConfig
from spectune.errors import SpectuneError

if TYPE_CHECKING:
    from spectune.scoring import Score

CEILINGS = (0.0, 1.2, 1.67, 2.0, 3.0)  # 0 = off; the others as in SGLang's presets


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """Slot bounds come from the measured batch sizes, ladders from the step counts 0..the largest measured
    (the traces are exact below their horizon and the round cost is linear in g)."""

    batch_sizes: tuple[int, ...]
    steps: tuple[int, ...]

    def suggest(self, trial) -> AdaptiveConfig:
        bounds = [1] + [b for b in self.batch_sizes[1:] if trial.suggest_categorical(f"split_{b}", [False, True])]
        shared = dict(
            ema_alpha=trial.suggest_float("ema_alpha", 0.05, 0.9),
            update_interval=trial.suggest_int("update_interval", 1, 16),
            warmup_batches=trial.suggest_int("warmup_batches", 0, 20),
            down_hysteresis=trial.suggest_float("down_hysteresis", -1.0, 0.25),
            up_hysteresis=trial.suggest_float("up_hysteresis", -0.25, 1.0),
        )
        slots = {}
        for b in bounds:
            lo, hi = sorted((trial.suggest_categorical(f"lo_{b}", self.steps), trial.suggest_categorical(f"hi_{b}", self.steps)))
            ladder = [g for g in self.steps if lo <= g <= hi]
            if trial.suggest_categorical(f"sparse_{b}", [False, True]):
                ladder = sorted(set(ladder[::2] + ladder[-1:]))
            slots[b] = SlotConfig(candidate_steps=ladder, ceiling_coeff=trial.suggest_categorical(f"ceiling_{b}", CEILINGS), **shared)
        return AdaptiveConfig(slots=slots)

    def params_for(self, steps_by_batch_size: dict[int, int]) -> dict[str, object]:
        """The trial parameters of a config with one fixed step count per batch-size range (a slot where it
        changes), SGLang's default tuning values elsewhere."""
        params: dict[str, object] = dict(ema_alpha=0.2, update_interval=5, warmup_batches=10, down_hysteresis=-0.25, up_hysteresis=0.0)
        previous = None
        for b in self.batch_sizes:
            g = steps_by_batch_size[b]
            if previous is not None:
                params[f"split_{b}"] = g != previous
            if g != previous:
                params.update({f"lo_{b}": g, f"hi_{b}": g, f"sparse_{b}": False, f"ceiling_{b}": 0.0})
            previous = g
        return params


def open_study(storage: str, name: str, seed: int):
    """Create or join the study `name` in an Optuna RDB storage URL."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed)
    return optuna.create_study(storage=storage_for(storage), study_name=name, direction="maximize", sampler=sampler, load_if_exists=True)


def storage_for(url: str, **rdb_options):
    """An Optuna storage for a URL. SQLite runs in WAL mode without an fsync per commit: Optuna commits
    every suggested parameter, which otherwise costs ~15 ms each here (a trial took 0.7 s). A plain
    postgresql:// URL gets the driver that is installed (SQLAlchemy 2.1 assumes psycopg 3). rdb_options go to
    RDBStorage (heartbeat_interval, grace_period, failed_trial_callback: spectune.distributed)."""
    import importlib.util
    import sqlite3

    given = url
    if url.startswith("postgresql://"):
        driver = next((d for d in ("psycopg", "psycopg2") if importlib.util.find_spec(d)), None)
        if driver is None:
            raise SpectuneError(f"storage {redact(given)}: PostgreSQL needs a driver this Python lacks; "
                                "pip install psycopg2-binary (the postgres extra: pip install '.[engine,postgres]' in spectune's "
                                "checkout), then run again")
        url = url.replace("postgresql://", f"postgresql+{driver}://", 1)
    engine_kwargs = {}
    if url.startswith("sqlite:///"):
        path = url.removeprefix("sqlite:///")

        def connect() -> sqlite3.Connection:
            conn = sqlite3.connect(path, timeout=60, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            return conn

        engine_kwargs = {"creator": connect}
    return _schema_ready_rdb(url, given, engine_kwargs, **rdb_options)


def _schema_ready_rdb(url: str, given: str, engine_kwargs: dict, attempts: int = 5, **rdb_options):
    """Workers that start together race to create Optuna's tables in an empty database (PostgreSQL and SQLite
    alike): the loser's CREATE TABLE or its schema-version row fails on what the winner just made. Retrying finds
    them there. A database that cannot be reached at all is the user's to fix: one line naming the URL as given."""
    import optuna
    import sqlalchemy.exc

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, **rdb_options)
        except sqlalchemy.exc.DBAPIError as e:
            raced = (isinstance(e, (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError))
                     or "already exists" in str(e) or "database is locked" in str(e))  # SQLite: another worker's DDL
            if not raced or attempt == attempts - 1:
                cause = " ".join(str(e.orig).split()) if e.orig is not None else type(e).__name__
                raise SpectuneError(f"storage {redact(given)}: cannot open it as an Optuna storage ({cause}); start the database "
                                    "server or fix the URL (sqlite:////abs/path.db on one machine, "
                                    "postgresql://user:pw@host/db for several)") from e
            time.sleep(0.2 * (attempt + 1))  # let the other worker finish creating the schema


def run_trials(study, space: SearchSpace, evaluate: Callable[[AdaptiveConfig], Score], n_trials: int, log: Callable[[str], None]) -> None:
    """Ask/tell loop. A trial whose config is invalid or whose simulation fails is told FAIL, with the
    cause in its user attribute "error"; the study goes on."""
    from optuna.trial import TrialState

    worker = f"{socket.gethostname()}:{os.getpid()}"
    for _ in range(n_trials):
        trial = study.ask()
        trial.set_user_attr("worker", worker)
        try:
            cfg = space.suggest(trial)
            trial.set_user_attr("config", cfg.to_dict())
            score = evaluate(cfg)
        except Exception as e:  # one bad trial must not end the study; its cause is kept
            trial.set_user_attr("error", f"{type(e).__name__}: {e}")
            study.tell(trial, state=TrialState.FAIL)
            log(f"trial {trial.number} failed: {type(e).__name__}: {e}")
            continue
        trial.set_user_attr("per_trace", score.figures)
        study.tell(trial, score.speedup)


def trial_counts(study) -> tuple[int, int]:
    from optuna.trial import TrialState

    states = [t.state for t in study.get_trials(deepcopy=False)]
    return states.count(TrialState.COMPLETE), states.count(TrialState.FAIL)


def redact(url: str) -> str:
    """The storage URL without its password, for files and logs."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    credentials, _, host = rest.rpartition("@")
    return f"{scheme}{sep}{credentials.split(':')[0]}:***@{host}"
