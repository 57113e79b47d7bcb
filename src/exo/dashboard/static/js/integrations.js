export function mountIntegrations(section) {
  return {};
}
