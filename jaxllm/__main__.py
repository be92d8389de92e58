import sys

from jaxllm.generate import main

sys.exit(main())
