"""Client, AsyncClient and RunHandle: submit, read and steer runs."""
