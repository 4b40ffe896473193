#!/usr/bin/env python3
"""The kubectl / flexinfer / flux / make commands of a runbook, with the cluster state each one assumes.

usage: commands.py DOC.md   -> JSON list on stdout: [{"section", "line", "command", "state", "reason"}]

Commands are the lines of the ```bash / ```sh blocks (a trailing backslash joins the next line; comment lines
and blank lines are not commands) and the inline code spans of the text that start with `kubectl ` or
`flexinfer `. `state` says what the command needs in order to be run as written:
  cache    a ModelCache `<name>` (any phase)
  running  its quantize Job with a running pod (`$POD` / `<quantize pod>`)
  failed   a ModelCache that has failed (the recovery steps)
  model    a Model `<name>` with a pod `<pod>`
  skip     not runnable in the test cluster; `reason` says why and what covers it instead
The real-pipeline test (tests/tests/real_pipeline/, real_pipeline_runbook_commands_work_as_written) runs every
command that is not `skip` against the real node in that state. A command no rule below matches is `cache`: a new
command in the runbook is run, not silently skipped.
"""
import json
import re
import sys

# (pattern, state, reason): first match wins.
RULES = [
    ("\u2026", "skip", "an abbreviation (…) of a command given in full nearby"),
    (r"^flux ", "skip", "Flux is not installed in the test cluster (install.md documents the Kustomizations)"),
    (r"^kubectl top\b", "skip", "needs metrics-server, which the test cluster does not run"),
    (r"^make deploy-quantizer ", "skip",
     "a synopsis with optional [ARGS]; real_pipeline_deploy_quantizer_moves_a_running_quantization_to_the_new_image "
     "runs scripts/deploy-quantizer.sh, which it calls"),
    (r"--subresource=status", "failed", ""),
    (r"reset-retries", "failed", ""),
    (r"\$POD|<quantize pod>|-l job-name=<name>-quantize", "running", ""),
    (r"force-image-update", "running", ""),
    (r"^kubectl delete job .*<name>-quantize", "running", ""),
    (r"^kubectl logs .*job/<name>-quantize", "running", ""),
    (r"requantize=true", "failed", ""),
    (r"\bmodel <name>|<pod>|app\.kubernetes\.io/instance=<name>", "model", ""),
]


def commands(text):
    out, section, block, pending, start = [], "", None, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        if block is None:
            m = re.match(r"^#+\s+(.*)", line)
            if m:
                section = m.group(1).strip()
            m = re.match(r"^\s*```(\w*)", line)
            if m:
                block = m.group(1)
                continue
            for span in re.findall(r"`((?:kubectl|flexinfer) [^`]+)`", line):
                out.append(classify(section, n, span.strip()))
            continue
        if re.match(r"^\s*```", line):
            block = None
            continue
        if block not in ("bash", "sh", "shell"):
            continue
        s = line.strip()
        if not pending and (not s or s.startswith("#")):
            continue
        if not pending:
            start = n
        if s.endswith("\\"):
            pending += s[:-1].rstrip() + " "
            continue
        cmd = (pending + s).strip()
        pending = ""
        out.append(classify(section, start, cmd))
    return out


def classify(section, line, cmd):
    state, reason = "cache", ""
    for pat, st, why in RULES:
        if re.search(pat, cmd):
            state, reason = st, why
            break
    return {"section": section, "line": line, "command": cmd, "state": state, "reason": reason}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    found = commands(open(sys.argv[1]).read())
    if not found:
        sys.exit(f"no commands found in {sys.argv[1]}")
    json.dump(found, sys.stdout, indent=1)
