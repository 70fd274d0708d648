import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
import vllm.benchmarks.serve as s
p = FlexibleArgumentParser(); s.add_cli_args(p); s.main(p.parse_args(sys.argv[1:]))
