from paged_llm.cli.serve import main

raise SystemExit(main())
