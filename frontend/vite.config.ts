import { defineConfig } from "vite";

// The API serves dist/ as static files at "/" with hash routing, so every asset path is relative
// and no server-side fallback route is needed.
export default defineConfig({
  base: "./",
  build: { outDir: "dist", emptyOutDir: true, chunkSizeWarningLimit: 300 },
  server: {
    // `npm run dev` against an API on :8000 (make demo)
    proxy: { "/api": "http://127.0.0.1:8000" },
  },
});
