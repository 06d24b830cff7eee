"""The schema after all 19 migrations, written from the schema reference (spec/000).

Columns are (name, data type as information_schema spells it, nullable).
"""

from __future__ import annotations

TS = "timestamp with time zone"

TABLES: dict[str, list[tuple[str, str, bool]]] = {
    "cyclone_runs": [
        ("id", "bigint", False),
        ("workflow", "text", False),
        ("def_version", "text", False),
        ("input", "jsonb", True),
        ("state", "text", False),
        ("created_at", TS, False),
        ("updated_at", TS, False),
        ("finished_at", TS, True),
        ("deadline_at", TS, True),
        ("result_node", "text", True),
        ("submit_key", "text", True),
        ("has_fan_out", "boolean", False),
        ("paused_at", TS, True),
        ("parent_run_id", "bigint", True),
        ("parent_node_id", "text", True),
    ],
    "cyclone_steps": [
        ("id", "bigint", False),
        ("run_id", "bigint", False),
        ("node", "text", False),
        ("kind", "text", False),
        ("state", "text", False),
        ("input", "jsonb", True),
        ("output", "jsonb", True),
        ("input_from", "text", True),
        ("queue", "text", False),
        ("priority", "integer", False),
        ("attempt", "integer", False),
        ("max_attempts", "integer", False),
        ("scheduled_at", TS, False),
        ("timeout", "interval", True),
        ("signal_name", "text", True),
        ("signal_names", "ARRAY", True),
        ("wait_for", "interval", True),
        ("wait_count", "integer", True),
        ("on_dep_failure", "text", True),
        ("sequence_key", "text", True),
        ("unique_key", "text", True),
        ("parent_node", "text", True),
        ("unique_until", TS, True),
        ("lease_owner", "text", True),
        ("lease_expiry", TS, True),
        ("heartbeat_at", TS, True),
        ("lease_generation", "bigint", False),
        ("reclaims", "integer", False),
        ("fan_out_parallel", "integer", True),
        ("fan_out_max_bytes", "bigint", True),
        ("item_of", "text", True),
        ("item_index", "integer", True),
        ("child_workflow", "text", True),
        ("child_needs_result", "boolean", True),
        ("error", "text", True),
        ("error_kind", "text", True),
        ("panic_stack", "text", True),
        ("retention", "interval", True),
        ("created_at", TS, False),
        ("started_at", TS, True),
        ("completed_at", TS, True),
    ],
    "cyclone_deps": [
        ("run_id", "bigint", False),
        ("node", "text", False),
        ("dep_node", "text", False),
        ("dep_type", "text", False),
    ],
    "cyclone_step_inputs": [
        ("run_id", "bigint", False),
        ("node", "text", False),
        ("slot", "integer", False),
        ("dep_node", "text", False),
        ("assembly_mode", "text", False),
    ],
    "cyclone_signals": [
        ("id", "bigint", False),
        ("run_id", "bigint", False),
        ("name", "text", False),
        ("payload", "jsonb", True),
        ("created_at", TS, False),
        ("consumed_by", "text", True),
        ("consumed_at", TS, True),
    ],
    "cyclone_schedules": [
        ("id", "text", False),
        ("kind", "text", False),
        ("input", "jsonb", True),
        ("cron_spec", "text", False),
        ("location", "text", False),
        ("next_run_at", TS, False),
        ("enabled", "boolean", False),
        ("lease_owner", "text", True),
        ("lease_expiry", TS, True),
        ("last_run_id", "bigint", True),
        ("last_error", "text", True),
        ("consecutive_failures", "integer", False),
        ("max_attempts", "integer", False),
        ("timeout", "interval", True),
        ("queue", "text", False),
        ("priority", "integer", False),
        ("retention", "interval", True),
        ("def_version", "text", True),
        ("created_at", TS, False),
        ("updated_at", TS, False),
    ],
    "cyclone_schedule_fires": [
        ("schedule_id", "text", False),
        ("scheduled_for", TS, False),
        ("run_id", "bigint", False),
        ("created_at", TS, False),
    ],
    "cyclone_schema_version": [("version", "integer", False)],
}

DEFAULTS: dict[tuple[str, str], str] = {
    ("cyclone_runs", "state"): "'running'::text",
    ("cyclone_runs", "has_fan_out"): "false",
    ("cyclone_steps", "state"): "'pending'::text",
    ("cyclone_steps", "queue"): "'default'::text",
    ("cyclone_steps", "priority"): "0",
    ("cyclone_steps", "attempt"): "0",
    ("cyclone_steps", "max_attempts"): "5",
    ("cyclone_steps", "lease_generation"): "0",
    ("cyclone_steps", "reclaims"): "0",
    ("cyclone_deps", "dep_type"): "'control'::text",
    ("cyclone_step_inputs", "assembly_mode"): "'tuple'::text",
    ("cyclone_schedules", "max_attempts"): "5",
    ("cyclone_schedules", "enabled"): "true",
    ("cyclone_schedules", "consecutive_failures"): "0",
}

PRIMARY_KEYS: dict[str, list[str]] = {
    "cyclone_runs": ["id"],
    "cyclone_steps": ["id"],
    "cyclone_deps": ["run_id", "node", "dep_node"],
    "cyclone_step_inputs": ["run_id", "node", "slot"],
    "cyclone_signals": ["id"],
    "cyclone_schedules": ["id"],
    "cyclone_schedule_fires": ["schedule_id", "scheduled_for"],
}

# (table, columns, referenced table, referenced columns, ON DELETE action code)
# Action codes are pg_constraint.confdeltype: c = cascade, n = set null.
FOREIGN_KEYS: set[tuple[str, tuple[str, ...], str, tuple[str, ...], str]] = {
    ("cyclone_steps", ("run_id",), "cyclone_runs", ("id",), "c"),
    ("cyclone_deps", ("run_id",), "cyclone_runs", ("id",), "c"),
    ("cyclone_step_inputs", ("run_id", "node"), "cyclone_steps", ("run_id", "node"), "c"),
    ("cyclone_step_inputs", ("run_id", "dep_node"), "cyclone_steps", ("run_id", "node"), "c"),
    ("cyclone_signals", ("run_id",), "cyclone_runs", ("id",), "c"),
    ("cyclone_schedules", ("last_run_id",), "cyclone_runs", ("id",), "n"),
    ("cyclone_schedule_fires", ("schedule_id",), "cyclone_schedules", ("id",), "c"),
    ("cyclone_schedule_fires", ("run_id",), "cyclone_runs", ("id",), "c"),
}

CHECKS = {
    "cyclone_runs_state_check",
    "cyclone_steps_state_check",
    "cyclone_steps_queue_check",
    "cyclone_schedules_queue_check",
    "cyclone_steps_max_attempts_check",
}

# index name -> (table, unique, a fragment its definition must contain)
INDEXES: dict[str, tuple[str, bool, str]] = {
    "idx_steps_claim": ("cyclone_steps", False, "(queue, priority DESC, scheduled_at)"),
    "idx_steps_lease": ("cyclone_steps", False, "(lease_expiry)"),
    "idx_steps_timer": ("cyclone_steps", False, "'waiting_timer'"),
    "idx_steps_signal": ("cyclone_steps", False, "(run_id, signal_name)"),
    "idx_steps_signal_timeout": ("cyclone_steps", False, "wait_for IS NOT NULL"),
    "idx_steps_timeout": ("cyclone_steps", False, "(started_at)"),
    "idx_steps_signal_name_unique": ("cyclone_steps", True, "(run_id, signal_name)"),
    "idx_steps_unique_active": ("cyclone_steps", True, "'paused'"),
    "idx_steps_sequence": ("cyclone_steps", False, "'paused'"),
    "idx_signals_unconsumed": ("cyclone_signals", False, "(run_id, name, id)"),
    "idx_signals_run": ("cyclone_signals", False, "(run_id)"),
    "idx_schedule_fires_run": ("cyclone_schedule_fires", False, "(run_id)"),
    "idx_deps_depnode": ("cyclone_deps", False, "(run_id, dep_node)"),
    "idx_step_inputs_depnode": ("cyclone_step_inputs", False, "(run_id, dep_node)"),
    "idx_schedules_due": ("cyclone_schedules", False, "(next_run_at)"),
    "idx_schedules_lease": ("cyclone_schedules", False, "(lease_expiry)"),
    "idx_runs_state_id": ("cyclone_runs", False, "(state, id DESC)"),
    "idx_runs_deadline": ("cyclone_runs", False, "(deadline_at)"),
    "idx_runs_submit_key": ("cyclone_runs", True, "(workflow, submit_key)"),
    "idx_steps_fan_out": ("cyclone_steps", False, "fan_out_parallel IS NOT NULL"),
    "idx_steps_items": ("cyclone_steps", False, "(run_id, item_of, state, item_index)"),
    "idx_runs_parent": ("cyclone_runs", True, "(parent_run_id, parent_node_id)"),
    "idx_steps_waiting_child": ("cyclone_steps", False, "'waiting_child'"),
}

VIEWS: dict[str, set[str]] = {
    "cyclone_v_runs": {
        "id", "workflow", "state", "created_at", "updated_at", "finished_at", "steps_total",
        "steps_completed", "steps_discarded", "steps_running", "steps_waiting_signal",
        "steps_waiting_timer", "parent_run_id", "parent_node_id",
    },
    "cyclone_v_steps": {
        "id", "run_id", "node", "kind", "state", "attempt", "max_attempts", "error",
        "error_kind", "lease_owner", "lease_expiry", "lease_expired", "heartbeat_at",
        "created_at", "started_at", "completed_at", "signal_name", "panic_stack", "reclaims",
        "item_of", "item_index",
    },
    "cyclone_v_kinds": {"kind", "state", "count", "oldest_available_age", "expired_leases"},
    "cyclone_v_queues": {
        "queue", "available", "running", "waiting", "oldest_available_age", "expired_leases",
    },
}

STEP_STATES = {
    "pending", "available", "running", "waiting_signal", "waiting_timer", "waiting_child",
    "paused", "completed", "discarded", "cancelled",
}
RUN_STATES = {"running", "paused", "completed", "failed", "cancelled"}
