"""The adapter store: uploads and fetches through ``loraplex-store`` processes, Redis reads."""
