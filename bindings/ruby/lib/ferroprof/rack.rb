# frozen_string_literal: true

require "ferroprof"

module Ferroprof
  # Rack middleware: each request's samples (CPU, wall, allocations on its thread) carry a
  # `local root span id` of their own, and the request's endpoint names them (`trace
  # endpoint`), so a profile splits by route:
  #
  #   use Ferroprof::Rack                        # config.ru, before other middleware
  #   config.middleware.insert_before 0, Ferroprof::Rack    # Rails: first, so its own
  #                                                         # middleware counts as the request
  #
  # The endpoint is, in order: env["ferroprof.endpoint"] (set by the app), Rails'
  # `Controller#action`, Sinatra's route (`GET /users/:id`), REQUEST_METHOD and the template in
  # env["ferroprof.route"], else REQUEST_METHOD alone (paths are not used: they would make one
  # endpoint per URL).
  class Rack
    def initialize(app)
      @app = app
    end

    def call(env)
      span = Context.next_span
      now = Context.current
      Context.with(Context::State.new(span, now.labels, now.labels_id)) do
        @app.call(env)
      ensure
        Native._native_record_endpoint(span, self.class.endpoint(env)) if Ferroprof.running?
      end
    end

    def self.endpoint(env)
      named = env["ferroprof.endpoint"]
      return named.to_s if named

      params = env["action_dispatch.request.path_parameters"]
      if params && params[:controller] && params[:action]
        controller = params[:controller].to_s.split("/").map { |p| p.split("_").map(&:capitalize).join }.join("::")
        return "#{controller}Controller##{params[:action]}"
      end
      route = env["sinatra.route"]
      return route.to_s if route

      method = env["REQUEST_METHOD"].to_s
      template = env["ferroprof.route"]
      template ? "#{method} #{template}" : method
    end
  end
end
