"""Connections, pools and the embedded server: no business logic here."""
