"""Pool providers: sandbox (Python subprocesses), desktop (OSWorld DesktopEnv), command (shell),
memory (tests)."""
