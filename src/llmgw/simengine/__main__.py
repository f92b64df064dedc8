from llmgw.simengine.server import main

raise SystemExit(main())
