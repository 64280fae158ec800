"""What every command of the command line shares: the consoles (markup and emoji off) and the
one-line error with exit code 2 (docs/architecture.md, "Module map": ``cli``).
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape

HELP_OPTIONS = {"help_option_names": ["--help", "-h"]}
"""-h works like --help in every command."""
# markup off: messages carry paths and "[...]" text; markup is asked for where it is used; emoji off:
# user values such as "cuda:abc" or "x:fire:y" are printed as typed, not as emoji
err_console = Console(stderr=True, markup=False, emoji=False)
console = Console(markup=False, emoji=False)


def _error(message: str) -> None:
    """Print ``error: message`` on stderr and exit with code 2."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True, markup=True)
    sys.exit(2)
