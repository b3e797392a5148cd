"""``python -m flowpacer ...``: the same command as the installed ``flowpacer``."""
from flowpacer.surfaces.cli import main

main(prog_name="flowpacer")
