"""Project-wide pieces every package may import (they import nothing of the project)."""
