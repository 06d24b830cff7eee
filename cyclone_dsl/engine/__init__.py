"""The engine core: the only writer of state transitions.

Every function here runs inside a transaction the caller opened (a
:class:`~cyclone_dsl.db.tx.Tx`), locks run rows before step rows (runs in id
order, then steps in id order) and guards every step write with the state and
``lease_generation`` it expects, so a stale worker or a racing scanner changes
nothing.
"""
