from paged_llm.openai.server import main

raise SystemExit(main())
