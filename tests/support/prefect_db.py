"""A migrated Prefect database for a test's ``PREFECT_HOME``, copied instead of migrated again.

A new SQLite database runs Prefect's ~110 Alembic migrations before its server answers: 5-10 s of
CPU on 2 cores, paid by every test that points a server, a CLI run or a benchmark at a new home.
The migrated result is the same file each time, so it is made once (per Prefect version and set of
migration scripts, kept under the system's temporary directory) and copied into each new home:
what a user's second run finds. A test of what a *new* database does (the private server's start
lock, a first run on a fresh machine) asks for none: ``cli_env(..., fresh_database=True)``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: the file name Prefect gives its SQLite database under PREFECT_HOME
DB_NAME = "prefect.db"


def _template_key() -> str:
    """Prefect's version and the names of its SQLite migrations: a template made by another
    Prefect is never copied."""
    import prefect

    versions = Path(prefect.__file__).parent / "server" / "database" / "_migrations" / "versions" / "sqlite"
    names = sorted(p.name for p in versions.glob("*.py"))
    digest = hashlib.sha256("\n".join([prefect.__version__, *names]).encode()).hexdigest()[:16]
    return f"{prefect.__version__}-{digest}"


def template_database() -> Path:
    """The migrated template database, made on first use by ``prefect server database upgrade``
    in a child process (nothing of Prefect's settings enters this one). Made in a private folder
    and renamed into place, so a concurrent test process never copies a half-written file."""
    root = Path(tempfile.gettempdir()) / "espnet3-flows-test-prefect-db"
    target = root / f"{_template_key()}.db"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="making-", dir=root))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(PREFECT_HOME=str(work), PREFECT_SERVER_ANALYTICS_ENABLED="false")
        proc = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                              env=env, capture_output=True, text=True, timeout=300)
        made = work / DB_NAME
        if proc.returncode != 0 or not made.is_file():
            raise RuntimeError(f"could not make the template Prefect database (exit {proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        os.replace(made, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def seed_home(home: Path) -> Path:
    """``home`` with a copy of the migrated database in it, unless it has a database already or
    Prefect cannot be imported here (the lent GPU machine, and ``gpu_check.sh --rehearse``: its
    commands make no database)."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    db = home / DB_NAME
    if not db.exists():
        try:
            template = template_database()
        except ImportError:
            return home
        partial = home / f".{DB_NAME}.copying"
        shutil.copyfile(template, partial)
        os.replace(partial, db)
    return home
