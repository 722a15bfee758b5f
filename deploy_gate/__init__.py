"""deploy_gate component."""
