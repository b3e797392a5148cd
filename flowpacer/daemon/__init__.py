"""The daemon: app.py wires the stages; the reconciler (flow table -> engine -> backend under one
lock), the backend supervisor, the supervised stages.
"""
