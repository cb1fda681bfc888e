from paged_llm.frontend.server import main

raise SystemExit(main())
