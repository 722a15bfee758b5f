from flywheel.cli import app

app(prog_name="flywheel")
