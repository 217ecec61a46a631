#!/usr/bin/env python3
"""The ``elastic`` command as a plain script, for launchers that run a file rather than a
console script, such as the cluster launcher's ``ray submit CLUSTER.yaml scripts/elastic_entry.py
run job.yaml`` (it copies this file to the head node and runs it there with its arguments).
elastic must be installed on the cluster's nodes (see clusters/launcher/*.yaml setup_commands).
"""

import sys

from elastic.cli import main

if __name__ == "__main__":
    sys.exit(main())
