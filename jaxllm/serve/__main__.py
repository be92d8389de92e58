"""`python -m jaxllm.serve`: the server's command line (jaxllm.serve.cli)."""
import sys

from jaxllm.serve.cli import main

sys.exit(main())
