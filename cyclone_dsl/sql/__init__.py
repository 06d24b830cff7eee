"""Every runtime SQL statement of Cyclone, as named, parameterised queries.

The text lives in the ``.sql`` files beside this module; :data:`Q` exposes
each query as a typed attribute so that a misspelled name fails at import
and under mypy. Values are always bind parameters, never interpolated.
"""

from __future__ import annotations

from typing import LiteralString

from cyclone_dsl.sql._loader import load_queries


class _Queries:
    # bulk.sql
    bulk_bound: LiteralString
    bulk_count: LiteralString
    bulk_lock_page: LiteralString
    # children.sql
    finish_child_nodes: LiteralString
    open_descendants: LiteralString
    child_run_of: LiteralString
    unstarted_children: LiteralString
    waiting_child_nodes: LiteralString
    ended_children_of_waiting_nodes: LiteralString
    open_child_runs_of_nodes: LiteralString
    versions_of_runs: LiteralString
    has_unstarted_children: LiteralString
    # claim.sql
    claim_steps: LiteralString
    heartbeat_steps: LiteralString
    leases_held: LiteralString
    hold_lease: LiteralString
    release_steps: LiteralString
    assemble_inputs: LiteralString
    lease_states: LiteralString
    # complete.sql
    lock_runs_of_steps: LiteralString
    lock_runs: LiteralString
    lock_open_siblings: LiteralString
    complete_steps: LiteralString
    fail_steps: LiteralString
    dependents_of_nodes: LiteralString
    activate_ready: LiteralString
    activate_dependents: LiteralString
    finish_runs: LiteralString
    end_runs: LiteralString
    cancel_open_steps: LiteralString
    cancel_downstream: LiteralString
    queues_next_in_sequences: LiteralString
    # control.sql
    run_tree: LiteralString
    get_run_state: LiteralString
    get_run_states: LiteralString
    node_state: LiteralString
    retry_run: LiteralString
    retry_child_runs: LiteralString
    retry_steps: LiteralString
    retry_deps: LiteralString
    retry_reset_steps: LiteralString
    retry_reset_items: LiteralString
    retry_reopen_run: LiteralString
    replay_reset_steps: LiteralString
    replay_drop_items: LiteralString
    fork_source: LiteralString
    fork_source_steps: LiteralString
    fork_copy: LiteralString
    fork_of: LiteralString
    fork_source_run: LiteralString
    # events.sql
    record_event: LiteralString
    record_events: LiteralString
    fence_events: LiteralString
    run_events_after: LiteralString
    followed_events: LiteralString
    # fanout.sql
    expand_fan_outs: LiteralString
    fan_out_sources: LiteralString
    activate_next_items: LiteralString
    finish_fan_out: LiteralString
    discard_node: LiteralString
    complete_node: LiteralString
    cancel_items: LiteralString
    fan_out_node: LiteralString
    fan_out_nodes_of_run: LiteralString
    discard_node_completed: LiteralString
    # flow.sql
    upsert_limits: LiteralString
    ensure_slots: LiteralString
    insert_gates: LiteralString
    gate_fan_out_items: LiteralString
    gate_window_end: LiteralString
    claim_gated_steps: LiteralString
    claim_capped_steps: LiteralString
    hold_queue_slots: LiteralString
    queue_caps: LiteralString
    queues_with_gates: LiteralString
    gated_queues: LiteralString
    queues_waiting_for_run_slots: LiteralString
    queues_waiting_for_step_slots: LiteralString
    delete_limit: LiteralString
    park_ended_gates: LiteralString
    park_gates_of_steps: LiteralString
    release_run_slots: LiteralString
    unpark_gates: LiteralString
    charge_rate_units: LiteralString
    flow_stats: LiteralString
    gate_wait_reasons: LiteralString
    lock_debounce_key: LiteralString
    open_debounce: LiteralString
    hold_debounced: LiteralString
    move_debounced: LiteralString
    delete_run_gates: LiteralString
    clear_lost_holders: LiteralString
    # metrics.sql
    database_gauges: LiteralString
    # migrate.sql
    migration_lock: LiteralString
    migration_unlock: LiteralString
    migration_lock_holder: LiteralString
    migration_session: LiteralString
    set_lock_timeout: LiteralString
    create_version_table: LiteralString
    read_version: LiteralString
    insert_version: LiteralString
    update_version: LiteralString
    read_ext_version: LiteralString
    insert_ext_version: LiteralString
    update_ext_version: LiteralString
    version_tables_exist: LiteralString
    set_migration_lock_timeout: LiteralString
    long_lock_holders: LiteralString
    read_only_transaction: LiteralString
    # read.sql
    get_run: LiteralString
    get_run_steps: LiteralString
    get_run_attempts: LiteralString
    list_runs: LiteralString
    run_outcome: LiteralString
    run_progress: LiteralString
    get_run_deps: LiteralString
    run_signals: LiteralString
    run_counts: LiteralString
    child_runs: LiteralString
    child_runs_of_run: LiteralString
    step_throughput: LiteralString
    # replica.sql
    standby_status: LiteralString
    wal_position: LiteralString
    replayed_to: LiteralString
    # retention.sql
    purge_runs: LiteralString
    purge_left: LiteralString
    expire_runs: LiteralString
    take_retention_look: LiteralString
    queue_stats: LiteralString
    kind_stats: LiteralString
    count_purgeable: LiteralString
    # scan.sql
    expired_leases: LiteralString
    reclaim_steps: LiteralString
    timed_out_steps: LiteralString
    scan_probe: LiteralString
    try_scan_leader: LiteralString
    wake_due_steps: LiteralString
    # schedules.sql
    db_now: LiteralString
    upsert_schedule: LiteralString
    delete_schedule: LiteralString
    list_schedules: LiteralString
    lease_due_schedules: LiteralString
    lock_leased_schedule: LiteralString
    release_schedule_lease: LiteralString
    record_fire: LiteralString
    schedule_fired: LiteralString
    schedule_retired: LiteralString
    schedule_failed: LiteralString
    disable_failed_schedule: LiteralString
    schedule_refused: LiteralString
    lock_schedule: LiteralString
    set_schedule_enabled: LiteralString
    # session.sql
    read_only: LiteralString
    keep_idle_session: LiteralString
    iso_dates: LiteralString
    watch_client: LiteralString
    completion_setup: LiteralString
    completion_reset: LiteralString
    completion_reset_watched: LiteralString
    transaction_age: LiteralString
    # signals.sql
    find_signal_wait: LiteralString
    count_buffered_signals: LiteralString
    insert_signal: LiteralString
    take_buffered_signals: LiteralString
    complete_wait: LiteralString
    record_partial_quorum: LiteralString
    find_wait_by_id: LiteralString
    runs_with_buffered_signals: LiteralString
    # submit.sql
    insert_run_graph: LiteralString
    find_run_by_submit_key: LiteralString
    find_active_unique: LiteralString
    notify_queues: LiteralString
    notify_runs_finished: LiteralString
    notify_steps_cancelled: LiteralString
    ping: LiteralString
    insert_run_graphs: LiteralString
    insert_fan_out_limits: LiteralString
    record_guards: LiteralString
    transaction_isolation: LiteralString
    # trace.sql
    insert_trace_contexts: LiteralString
    trace_contexts_of: LiteralString
    # waits.sql
    due_timers: LiteralString
    expired_signal_waits: LiteralString
    due_in_tree: LiteralString
    due_waits_in_order: LiteralString
    fire_timers: LiteralString
    time_out_signal_waits: LiteralString
    expired_deadlines: LiteralString
    pause_run: LiteralString
    resume_run: LiteralString
    # workers.sql
    lock_worker_registry: LiteralString
    handler_conflicts: LiteralString
    register_worker: LiteralString
    beat_worker: LiteralString
    stop_worker: LiteralString
    prune_workers: LiteralString
    list_workers: LiteralString
    unserved_work: LiteralString

    def __init__(self, queries: dict[str, str]) -> None:
        declared = set(type(self).__annotations__)
        missing, extra = declared - queries.keys(), queries.keys() - declared
        if missing or extra:
            raise RuntimeError(
                f"sql files and cyclone_dsl.sql disagree: missing {sorted(missing)}, "
                f"undeclared {sorted(extra)}"
            )
        for name, text in queries.items():
            object.__setattr__(self, name, text)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("queries are read-only")


Q = _Queries(load_queries(__name__))

__all__ = ["Q"]
