"""PostgreSQL's own figures for `pal bench control-plane`: rows and sizes of each table and
index, the statements each phase ran (``pg_stat_statements``: calls, rows, time; the
slowest), and the scans of each table (sequential ones on a large table are the walls).

Statements are grouped by their text as pg_stat_statements normalises it; a phase's
figures are the difference of two snapshots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from pal_tools.bench.fleet import libpq_url

# What the benchmark's PostgreSQL runs with (besides its defaults: fsync, synchronous commit
# and full page writes on). shared_buffers: a quarter of a node with 8 GiB, as one sizes it.
BENCH_SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.max": "10000",
    "pg_stat_statements.track": "all",
    "shared_buffers": "2GB",
    "effective_cache_size": "6GB",
    "work_mem": "16MB",
    "maintenance_work_mem": "512MB",
    "max_wal_size": "4GB",
    "max_connections": "400",
    "track_io_timing": "on",
}


@dataclass
class Statements:
    """pg_stat_statements at one moment: queryid -> (query, calls, rows, total ms, blocks)."""

    rows: dict[int, tuple[str, int, int, float, int]]

    def minus(self, before: Statements) -> list[dict[str, Any]]:
        out = []
        for qid, (query, calls, rows, ms, blocks) in self.rows.items():
            b = before.rows.get(qid, (query, 0, 0, 0.0, 0))
            dc = calls - b[1]
            if dc <= 0:
                continue
            out.append(
                {
                    "query": " ".join(query.split())[:400],
                    "calls": dc,
                    "rows": rows - b[2],
                    "totalMs": round(ms - b[3], 1),
                    "meanMs": round((ms - b[3]) / dc, 3),
                    "blocks": blocks - b[4],
                }
            )
        return sorted(out, key=lambda s: -s["totalMs"])


class PgFigures:
    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(libpq_url(url), autocommit=True)
        self.conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")

    def close(self) -> None:
        self.conn.close()

    def statements(self) -> Statements:
        got = self.conn.execute(
            "SELECT queryid, query, calls, rows, total_exec_time, shared_blks_hit + shared_blks_read "
            "FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchall()
        return Statements({int(q[0]): (str(q[1]), int(q[2]), int(q[3]), float(q[4]), int(q[5])) for q in got})

    def scans(self) -> dict[str, dict[str, int]]:
        """Each table's scans so far (its seq scans, the rows they read, its index scans)."""
        self.conn.execute("SELECT pg_stat_clear_snapshot()")
        rows = self.conn.execute(
            "SELECT relname, seq_scan, seq_tup_read, coalesce(idx_scan, 0), coalesce(idx_tup_fetch, 0) "
            "FROM pg_stat_user_tables"
        ).fetchall()
        return {
            str(r[0]): {
                "seqScans": int(r[1]),
                "seqRows": int(r[2]),
                "idxScans": int(r[3]),
                "idxRows": int(r[4]),
            }
            for r in rows
        }

    @staticmethod
    def scans_minus(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, Any]:
        out = {}
        for t, a in after.items():
            b = before.get(t, {})
            d = {k: v - b.get(k, 0) for k, v in a.items()}
            if any(d.values()):
                out[t] = d
        return out

    def sizes(self) -> dict[str, Any]:
        tables = self.conn.execute(
            "SELECT relname, n_live_tup, pg_relation_size(relid), pg_indexes_size(relid), "
            "pg_total_relation_size(relid) FROM pg_stat_user_tables "
            "ORDER BY pg_total_relation_size(relid) DESC"
        ).fetchall()
        indexes = self.conn.execute(
            "SELECT relname, indexrelname, pg_relation_size(indexrelid), idx_scan FROM pg_stat_user_indexes "
            "ORDER BY pg_relation_size(indexrelid) DESC"
        ).fetchall()
        db = self.conn.execute("SELECT pg_database_size(current_database())").fetchone()
        return {
            "databaseBytes": int(db[0]) if db else 0,
            "tables": {
                str(t[0]): {
                    "rows": int(t[1]),
                    "heapBytes": int(t[2]),
                    "indexBytes": int(t[3]),
                    "totalBytes": int(t[4]),
                }
                for t in tables
            },
            "indexes": {f"{i[0]}.{i[1]}": {"bytes": int(i[2]), "scans": int(i[3])} for i in indexes},
        }

    def settings(self) -> dict[str, str]:
        names = [
            "server_version",
            "fsync",
            "synchronous_commit",
            "full_page_writes",
            "shared_buffers",
            "work_mem",
        ]
        return {n: str(self.conn.execute(f"SHOW {n}").fetchone()[0]) for n in names}  # type: ignore[index]

    def explain(self, sql: str, params: dict[str, Any] | None = None) -> str:
        got = self.conn.execute(("EXPLAIN " + sql).encode(), params).fetchall()
        return "\n".join(str(r[0]) for r in got)
