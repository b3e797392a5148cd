"""The metric and label names a PromQL expression uses (the Grafana dashboard's and the
alerting rules' checks: only what the daemon exports)."""
import re

PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                "group_right", "bool", "offset", "inf", "nan"}


def promql_names(expr):
    """(metric names, label names) an expression uses."""
    labels = set()
    e = expr
    for m in re.finditer(r"\{([^}]*)\}", e):
        labels |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", m.group(1)))
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', e)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    for m in re.finditer(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", e):
        labels |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    metrics = set()
    for m in re.finditer(r"([a-zA-Z_:][\w:]*)\s*(\()?", e):
        word, call_ = m.group(1), m.group(2)
        if call_ or word.lower() in PROMQL_WORDS or re.fullmatch(r"\d.*", word):
            continue
        metrics.add(word)
    return metrics, labels
