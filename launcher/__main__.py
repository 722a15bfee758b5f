from launcher.cli import app

app(prog_name="flywheel")
