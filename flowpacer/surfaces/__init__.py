"""What people and programs read: the control socket, status view, metrics, the CLI, `top` and
`rules edit`.
"""
