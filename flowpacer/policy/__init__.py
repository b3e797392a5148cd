"""Policy: the rules loader (rules.py: a file -> an immutable RuleSet or every problem) and the
engine (engine.py: the one place that decides which rule a flow gets, and plans the Ops).
"""
